"""Scaled GEMMs for W8A8 in Triton: ``y = (a * sa) @ (w * sw)^T (+ b)`` on fp8 or int8 operands.

What: ``a [M, K]`` holds quantized activations (fp8 e4m3 or int8) with scales
``sa [M, KG]``, ``w [N, K]`` the quantized weight (the checkpoint's layout)
with scales ``sw [N, KG]``. ``KG`` is 1 (a scale per token / per output
channel; per-tensor scales arrive broadcast to one per row) or ``ceil(K /
GROUP_K)`` (a scale per token and per output row for each group of
``GROUP_K`` inputs: the 128x128 block-scaled fp8 of DeepSeek-V3, whose
``[N / 128, K / 128]`` block scales are expanded to rows at load time).

Why it is fast: the products run on the 8-bit tensor cores (``tl.dot`` on
fp8 accumulates in fp32, on int8 in int32 - exact), and scaling happens once
per tile: in the epilogue for per-token x per-channel scales, once per
``GROUP_K`` step for block scales (``BLOCK_K`` divides ``GROUP_K``).

The PyTorch twin is ``lmplug_quant.w8a8_common.scaled_mm_reference``;
activations are quantized before the call by ``w8a8_common`` (the same code on
both paths, so the kernel and the reference see the same 8-bit operands).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr, w_ptr, sa_ptr, sw_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_sam, stride_sak, stride_swn, stride_swk,
    stride_ym, stride_yn,
    GROUP_K: tl.constexpr, IS_INT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m-tile, n-tile] = sum_k a[m, k] w[n, k] * scales; GROUP_K == 0: scales in the epilogue."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 16)  # tl.dot's minimum tile
    tl.static_assert(GROUP_K == 0 or GROUP_K % BLOCK_K == 0)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if GROUP_K == 0 and IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        a_mask = m_mask[:, None] & k_mask[None, :]
        w_mask = k_mask[:, None] & n_mask[None, :]
        if IS_INT:
            a = tl.load(a_ptrs, mask=a_mask, other=0)  # [BM, BK]
            w = tl.load(w_ptrs, mask=w_mask, other=0)  # [BK, BN]
        else:  # fp8 takes a float fill value
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if GROUP_K == 0:
            if IS_INT:
                acc = tl.dot(a, w, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, w, acc, out_dtype=tl.float32)
        else:
            g = k0 // GROUP_K
            sa = tl.load(sa_ptr + offs_m * stride_sam + g * stride_sak, mask=m_mask, other=0.0)
            sw = tl.load(sw_ptr + offs_n * stride_swn + g * stride_swk, mask=n_mask, other=0.0)
            if IS_INT:
                part = tl.dot(a, w, out_dtype=tl.int32).to(tl.float32)
            else:
                part = tl.dot(a, w, out_dtype=tl.float32)
            acc += part * sa[:, None] * sw[None, :]
    if GROUP_K == 0:
        sa = tl.load(sa_ptr + offs_m * stride_sam, mask=m_mask, other=0.0)
        sw = tl.load(sw_ptr + offs_n * stride_swn, mask=n_mask, other=0.0)
        out = acc.to(tl.float32) * sa[:, None] * sw[None, :]
    else:
        out = acc
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_k_for(group_k: int) -> int | None:
    """The K tile for scale groups of ``group_k`` inputs (it must divide them); None: no tile fits."""
    if group_k == 0:
        return 64
    for block in (128, 64, 32, 16):
        if group_k % block == 0:
            return block
    return None


def w8a8_gemm(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, *,
              group_k: int = 0, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(a * sa) @ (w * sw)^T + bias`` -> ``[M, N]`` in ``out_dtype``.

    ``a [M, K]`` and ``w [N, K]`` both fp8 e4m3 or both int8; ``sa [M, KG]``, ``sw [N, KG]``
    float32 with ``KG`` 1 (``group_k`` 0) or ``ceil(K / group_k)``."""
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"w8a8_gemm: a {tuple(a.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if a.dtype != w.dtype or a.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"w8a8_gemm: a and w must both be int8 or float8_e4m3fn, got {a.dtype} and {w.dtype}")
    m, k = a.shape
    n = w.shape[0]
    kg = 1 if group_k == 0 else triton.cdiv(k, group_k)
    if tuple(sa.shape) != (m, kg) or tuple(sw.shape) != (n, kg):
        raise ValueError(f"w8a8_gemm: scales {tuple(sa.shape)} / {tuple(sw.shape)} must be "
                         f"[{m}, {kg}] / [{n}, {kg}] (group_k {group_k})")
    block_k = block_k_for(group_k)
    if block_k is None:
        raise ValueError(f"w8a8_gemm: scale groups of {group_k} inputs are not a multiple of 16")
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if n <= 32 or m <= 16 else 64
    block_k = min(block_k, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_gemm_kernel[grid](
        a, w, sa, sw, bias if bias is not None else y, y, m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), sa.stride(0), sa.stride(1),
        sw.stride(0), sw.stride(1), y.stride(0), y.stride(1),
        GROUP_K=group_k, IS_INT=a.dtype == torch.int8, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
