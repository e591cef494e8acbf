"""A dequantize-fused GEMM for GPTQ and AWQ weights in Triton: ``y = x @ W``, W never in memory.

What: ``W[k, n] = (q[k, n] - z[g[k], n]) * s[g[k], n]`` with ``q`` and ``z``
unpacked from int32 words, ``g = g_idx`` (the group of each input row, which
covers act-order), and ``y [M, N] = x [M, K] @ W``.

Why it is fast: decode reads every weight once per token, so its cost is the
bytes of ``W``; reading 4-bit words and dequantizing in registers right
before ``tl.dot`` moves a quarter of the bytes of fp16 weights. Each program
computes one ``[BLOCK_M, BLOCK_N]`` tile of ``y`` and walks ``K``.

One kernel serves both layouts through the constexpr ``AWQ_ORDER``:

- GPTQ (False): ``qweight [K / p, N]`` packed along K, value of row ``k`` at
  bits ``(k % p) * BITS``; ``qzeros [G, N / p]`` packed along N in order.
- AWQ (True, 4-bit): ``qweight [K, N / 8]`` and ``qzeros [G, N / 8]`` packed
  along N, column ``c`` of a word in nibble ``[0, 4, 1, 5, 2, 6, 3, 7][c]``
  (= ``c // 2 + (c % 2) * 4``), the inverse of AWQ's packing order.

GPTQ v1 zeros are converted to v2 at load time, so no ``+1`` happens here.
The PyTorch twins are ``lmplug_quant.gptq.gptq_dequantize`` and
``lmplug_quant.awq.awq_dequantize`` followed by a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _unpack(words, shifts, BITS: tl.constexpr):
    """The unsigned ``BITS``-bit value at ``shifts`` of each int32 word."""
    return (words >> shifts) & ((1 << BITS) - 1)


@triton.jit
def _column_shifts(offs_n, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """Bit position of column ``n`` inside its word, for weights/zeros packed along N."""
    PACK: tl.constexpr = 32 // BITS
    col = offs_n % PACK
    if AWQ_ORDER:
        col = col // 2 + (col % 2) * 4
    return col * BITS


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qwr, stride_qwc, stride_qzr, stride_qzc,
    stride_sr, stride_sc, stride_ym, stride_yn,
    BITS: tl.constexpr, AWQ_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """y[m-tile, n-tile] = x[m-tile, :] @ dequantize(W)[:, n-tile]."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 16)  # tl.dot's minimum tile
    tl.static_assert(not AWQ_ORDER or BITS == 4)  # AWQ's interleave is defined for 4 bits
    PACK: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    n_shifts = _column_shifts(offs_n, BITS, AWQ_ORDER)[None, :]  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w_mask = k_mask[:, None] & n_mask[None, :]
        groups = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]  # [BK, 1]
        if AWQ_ORDER:
            w_ptrs = qw_ptr + offs_k[:, None] * stride_qwr + (offs_n // PACK)[None, :] * stride_qwc
            q = _unpack(tl.load(w_ptrs, mask=w_mask, other=0), n_shifts, BITS)
        else:
            w_ptrs = qw_ptr + (offs_k // PACK)[:, None] * stride_qwr + offs_n[None, :] * stride_qwc
            k_shifts = ((offs_k % PACK) * BITS)[:, None]
            q = _unpack(tl.load(w_ptrs, mask=w_mask, other=0), k_shifts, BITS)
        z_ptrs = qz_ptr + groups * stride_qzr + (offs_n // PACK)[None, :] * stride_qzc
        z = _unpack(tl.load(z_ptrs, mask=w_mask, other=0), n_shifts, BITS)
        s = tl.load(s_ptr + groups * stride_sr + offs_n[None, :] * stride_sc, mask=w_mask, other=0.0)
        w = ((q - z).to(tl.float32) * s).to(x_ptr.dtype.element_ty)  # [BK, BN]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check_args(x, qweight, qzeros, scales, g_idx, bits: int, awq_order: bool) -> tuple[int, int, int]:
    if bits not in (4, 8) or (awq_order and bits != 4):
        raise ValueError(f"w4a16_gemm: {bits}-bit weights are not supported "
                         f"({'4' if awq_order else '4 or 8'} bits in the {'AWQ' if awq_order else 'GPTQ'} layout)")
    if x.dim() != 2:
        raise ValueError(f"w4a16_gemm: x must be [M, K], got {tuple(x.shape)}")
    pack = 32 // bits
    m, k = x.shape
    n = qweight.shape[1] * (pack if awq_order else 1)
    want = (k, n // pack) if awq_order else (k // pack, n)
    if tuple(qweight.shape) != want or k % (1 if awq_order else pack):
        raise ValueError(f"w4a16_gemm: qweight {tuple(qweight.shape)} does not fit x {tuple(x.shape)}")
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // pack):
        raise ValueError(f"w4a16_gemm: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} "
                         f"do not fit {n} output features")
    if tuple(g_idx.shape) != (k,):
        raise ValueError(f"w4a16_gemm: g_idx must be [{k}], got {tuple(g_idx.shape)}")
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("g_idx", g_idx)):
        if t.dtype != torch.int32:
            raise ValueError(f"w4a16_gemm: {name} must be int32, got {t.dtype}")
    return m, n, k


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor, *, bits: int = 4, awq_order: bool = False) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` with W dequantized on the fly; returns ``[M, N]`` in ``x.dtype``."""
    m, n, k = _check_args(x, qweight, qzeros, scales, g_idx, bits, awq_order)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx, y, m, n, k,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        qzeros.stride(0), qzeros.stride(1), scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1),
        BITS=bits, AWQ_ORDER=awq_order, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return y
