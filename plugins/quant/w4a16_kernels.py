"""A dequantize-fused GEMM for GPTQ and AWQ weights in Triton: ``y = x @ W``, W never in memory.

What: ``W[k, n] = (q[k, n] - z[g[k], n]) * s[g[k], n]`` with ``q`` and ``z``
unpacked from int32 words, ``g = g_idx`` (the group of each input row, which
covers act-order), and ``y [M, N] = x [M, K] @ W``.

Why it is fast: decode reads every weight once per token, so its cost is the
bytes of ``W``; reading 4-bit words and dequantizing in registers right
before ``tl.dot`` moves a quarter of the bytes of fp16 weights. Each program
computes one ``[BLOCK_M, BLOCK_N]`` tile of ``y`` and walks ``K``. Decode
batches of at most ``GEMV_MAX_M`` tokens take ``w4a16_gemv`` instead: no
``tl.dot`` (whose 16-row tile would be mostly padding), and ``K`` split over
several programs per output tile so that a small ``N`` still fills the GPU;
the partial sums (float32) are added on the host side.

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


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, part_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qwr, stride_qwc, stride_qzr, stride_qzc,
    stride_sr, stride_sc, stride_ps, stride_pm, stride_pn,
    BITS: tl.constexpr, AWQ_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Decode (M <= BLOCK_M tokens), split-K: program (n-tile, s) sums inputs
    [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) into ``part[s, :M, n-tile]``, with broadcast
    multiply-adds in float32 instead of ``tl.dot`` (whose 16-row minimum tile would waste most of
    its work on one token); the host sums the splits."""
    tl.static_assert(not AWQ_ORDER or BITS == 4)
    PACK: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    n_shifts = _column_shifts(offs_n, BITS, AWQ_ORDER)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        w_mask = k_mask[:, None] & n_mask[None, :]
        groups = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]
        if AWQ_ORDER:
            w_ptrs = qw_ptr + offs_k[:, None] * stride_qwr + (offs_n // PACK)[None, :] * stride_qwc
            q = _unpack(tl.load(w_ptrs, mask=w_mask, other=0), n_shifts, BITS)
        else:
            w_ptrs = qw_ptr + (offs_k // PACK)[:, None] * stride_qwr + offs_n[None, :] * stride_qwc
            q = _unpack(tl.load(w_ptrs, mask=w_mask, other=0), ((offs_k % PACK) * BITS)[:, None], BITS)
        z_ptrs = qz_ptr + groups * stride_qzr + (offs_n // PACK)[None, :] * stride_qzc
        z = _unpack(tl.load(z_ptrs, mask=w_mask, other=0), n_shifts, BITS)
        s = tl.load(s_ptr + groups * stride_sr + offs_n[None, :] * stride_sc, mask=w_mask, other=0.0)
        w = (q - z).to(tl.float32) * s  # [BK, BN]
        acc += tl.sum(a[:, :, None] * w[None, :, :], axis=1)
    p_ptrs = part_ptr + pid_s * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
    tl.store(p_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


GEMV_MAX_M = 4  # decode batches up to this many tokens take the split-K GEMV


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


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor, *, bits: int = 4, awq_order: bool = False,
               split_k: int | None = None) -> torch.Tensor:
    """The decode path of ``w4a16_gemm`` (``M <= GEMV_MAX_M``): split-K over ``split_k`` programs per
    output tile (default: enough to give the GPU ~256 programs), partial sums added here."""
    m, n, k = _check_args(x, qweight, qzeros, scales, g_idx, bits, awq_order)
    if m > GEMV_MAX_M:
        raise ValueError(f"w4a16_gemv: {m} rows; the GEMV path takes at most {GEMV_MAX_M}")
    block_n, block_k = 64, 32
    n_tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = max(1, min(k_blocks, triton.cdiv(256, n_tiles)))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    parts = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _w4a16_gemv_kernel[(n_tiles, split_k)](
        x, qweight, qzeros, scales, g_idx, parts, m, n, k, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        qzeros.stride(0), qzeros.stride(1), scales.stride(0), scales.stride(1),
        parts.stride(0), parts.stride(1), parts.stride(2),
        BITS=bits, AWQ_ORDER=awq_order, BLOCK_M=GEMV_MAX_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return parts.sum(0).to(x.dtype)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor, *, bits: int = 4, awq_order: bool = False) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` with W dequantized on the fly; returns ``[M, N]`` in ``x.dtype``.
    Decode batches (``M <= GEMV_MAX_M``) take the split-K GEMV."""
    m, n, k = _check_args(x, qweight, qzeros, scales, g_idx, bits, awq_order)
    if m <= GEMV_MAX_M:
        return w4a16_gemv(x, qweight, qzeros, scales, g_idx, bits=bits, awq_order=awq_order)
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
