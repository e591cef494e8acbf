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
per tile: in the epilogue for per-token x per-channel scales, once per K step
for group scales. The tiles come from a table per architecture and M bucket
(``w8a8_config``).

Scale groups: every K step lies inside one group. ``BLOCK_K`` is at least 32
(8-bit ``tl.dot`` needs K >= 32), so a group that is not a multiple of the
tile (48: DeepSeek-style blocks of odd width, or 16) is walked in
``ceil(GROUP_K / BLOCK_K)`` steps from the group's first input, the last one
masked at the group's end; a multiple of ``BLOCK_K`` takes whole steps.

fp8 accumulation: Hopper's fp8 MMA keeps fewer than fp32's mantissa bits
while it accumulates (Triton lets it run over the whole K by default on
sm_90), which drifts over long K. So every fp8 K step's product starts from a
fresh accumulator and is added to the fp32 total (what DeepSeek-V3's and
vLLM's block-fp8 GEMMs do), i.e. promotion every ``BLOCK_K`` (<= 128) inputs,
on every architecture (one add per tile, and one code path). int8 needs none:
int32 accumulation is exact.

The PyTorch twin is ``lmplug_quant.w8a8_common.scaled_mm_reference``;
activations are quantized before the call by ``w8a8_common`` (the same code on
both paths, so the kernel and the reference see the same 8-bit operands).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_quant.common import LaunchConfig, arch_key, m_bucket

from lmplug.kit.devices import capability


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
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 32)  # 8-bit tl.dot needs K >= 32
    STEPS: tl.constexpr = 1 if GROUP_K == 0 else (GROUP_K + BLOCK_K - 1) // BLOCK_K  # K steps per group
    EXACT: tl.constexpr = GROUP_K % BLOCK_K == 0  # steps never cross a group's end
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    # 64-bit tile bases (row x stride passes 2^31 for large M x K, N x K or M x N); in-tile offsets
    # stay 32-bit
    a_ptr += row0.to(tl.int64) * stride_am
    w_ptr += col0.to(tl.int64) * stride_wn
    sa_ptr += row0.to(tl.int64) * stride_sam
    sw_ptr += col0.to(tl.int64) * stride_swn
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M - row0
    n_mask = offs_n < N - col0
    if GROUP_K == 0 and IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GROUP_K == 0:
        num_steps = tl.cdiv(K, BLOCK_K)
    else:
        num_steps = tl.cdiv(K, GROUP_K) * STEPS
    for step in range(num_steps):
        if GROUP_K == 0:
            k0 = step * BLOCK_K
            k_mask = offs_k < K - k0
        else:
            g = step // STEPS
            within = (step % STEPS) * BLOCK_K
            k0 = g * GROUP_K + within
            k_mask = offs_k < K - k0
            if not EXACT:
                k_mask = k_mask & (offs_k < GROUP_K - within)
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
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
            else:  # a fresh accumulator per step, promoted into fp32 (module docstring)
                acc += tl.dot(a, w, out_dtype=tl.float32)
        else:
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
        out += tl.load(b_ptr + col0 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptr += row0.to(tl.int64) * stride_ym + col0.to(tl.int64) * stride_yn
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# -- the launch table ------------------------------------------------------------------------------
# (block_m, block_n, block_k, num_warps, num_stages) per architecture and M bucket (common.m_bucket).
# M <= 16 is GEMV-shaped: 16 rows (tl.dot's minimum), wide K steps, the grid over N tiles. Shared
# memory per stage is (BM + BN) * BK bytes: sm80 entries stay under ~100 KiB (sm_86/sm_89 too),
# sm90 ones use Hopper's deeper pipelines. fp8 K steps stay <= 128 (its promotion interval).
W8A8_TABLE: dict[str, dict[int, tuple[int, int, int, int, int]]] = {
    "sm80": {1: (16, 64, 128, 4, 4), 16: (16, 64, 128, 4, 4), 64: (64, 64, 128, 4, 3),
             128: (128, 128, 64, 8, 3)},
    "sm90": {1: (16, 64, 128, 4, 5), 16: (16, 64, 128, 4, 5), 64: (64, 128, 128, 4, 4),
             128: (128, 128, 128, 8, 4)},
}
# with scale groups each step's product is a second fp32 tile next to the accumulator: Hopper's
# 128 x 128 x 128 prefill tile then spills (ptxas, 8 warps), a 64-wide K step does not
GROUPED_PREFILL = {"sm80": (128, 128, 64, 8, 3), "sm90": (128, 128, 64, 8, 4)}
WIDE_N = 8192  # decode shapes with at least this many outputs take 128-wide N tiles (fewer programs)


def block_k_for(group_k: int, largest: int = 64) -> int:
    """The K step for scale groups of ``group_k`` inputs (0: one scale per row): at most ``largest``,
    at least 32 (8-bit ``tl.dot``), else the power of two that covers a group in one step."""
    if group_k == 0:
        return largest
    return min(largest, max(32, triton.next_power_of_2(group_k)))


def w8a8_config(cap: tuple[int, int] | None, m: int, n: int, k: int, group_k: int = 0) -> LaunchConfig:
    """The launch for ``[M, K] x [K, N]`` with scale groups of ``group_k`` on ``cap`` (None: the
    interpreter, small tiles)."""
    arch = arch_key(cap)
    if arch is None:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn = 32 if n <= 32 or m <= 16 else 64
        return LaunchConfig(bm, bn, block_k_for(group_k, 64))
    bucket = m_bucket(m)
    bm, bn, bk, warps, stages = GROUPED_PREFILL[arch] if group_k and bucket == 128 else W8A8_TABLE[arch][bucket]
    if bucket <= 16 and n >= WIDE_N:
        bn = 128
    return LaunchConfig(bm, bn, block_k_for(group_k, bk), warps, stages)


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
    if group_k < 0:
        raise ValueError(f"w8a8_gemm: group_k must be 0 (one scale per row) or positive, got {group_k}")
    m, k = a.shape
    n = w.shape[0]
    kg = 1 if group_k == 0 else triton.cdiv(k, group_k)
    if tuple(sa.shape) != (m, kg) or tuple(sw.shape) != (n, kg):
        raise ValueError(f"w8a8_gemm: scales {tuple(sa.shape)} / {tuple(sw.shape)} must be "
                         f"[{m}, {kg}] / [{n}, {kg}] (group_k {group_k})")
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    cfg = w8a8_config(capability(a.device), m, n, k, group_k)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _w8a8_gemm_kernel[grid](
        a, w, sa, sw, bias if bias is not None else y, y, m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), sa.stride(0), sa.stride(1),
        sw.stride(0), sw.stride(1), y.stride(0), y.stride(1),
        GROUP_K=group_k, IS_INT=a.dtype == torch.int8, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
