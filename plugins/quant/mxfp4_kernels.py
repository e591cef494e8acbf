"""MXFP4 weights in Triton: ``y = x @ W^T (+ bias)``, W decoded in registers from its packed blocks.

W ``[N, K]`` is ``blocks`` uint8 ``[N, K / 32, 16]`` (two FP4 E2M1 values a byte, element 2j in
the low nibble) and ``scales`` uint8 E8M0 ``[N, K / 32]`` (``mxfp4_ref`` has the format). Each
program computes a ``[BLOCK_M, BLOCK_N]`` tile of y and walks K in steps of ``BLOCK_K`` (a whole
number of 32-value blocks): it loads the step's bytes ``[BLOCK_N, BLOCK_K / 2]``, splits the
nibbles, decodes E2M1 arithmetically (sign, 2-bit exponent, 1-bit mantissa), interleaves low and
high nibbles back into element order, multiplies by ``2 ** (scale - 127)`` (built from its bits:
exact, subnormal 2^-127 and NaN for 255 included) and feeds ``tl.dot`` in x's dtype (float32 at
IEEE precision, so the fp32 path matches the reference to rounding). Decode reads a quarter of
the bytes of bf16 weights. Offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 64


@triton.jit
def _e2m1(nibble):
    """FP4 E2M1 -> float32: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    exp = (nibble >> 1) & 3
    man = (nibble & 1).to(tl.float32)
    mag = tl.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * (1 << tl.maximum(exp - 1, 0)).to(tl.float32))
    return tl.where((nibble & 8) != 0, -mag, mag)


@triton.jit
def _e8m0(scale):
    """E8M0 -> float32 2 ** (scale - 127) from its bits (255: NaN, 0: the subnormal 2^-127)."""
    s = scale.to(tl.int32)
    normal = (s << 23).to(tl.float32, bitcast=True)
    value = tl.where(s == 0, 5.877471754111438e-39, normal)
    return tl.where(s == 255, float("nan"), value)


@triton.jit
def _mxfp4_gemm_kernel(x_ptr, blocks_ptr, scales_ptr, bias_ptr, y_ptr, M, N, K,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_b = tl.arange(0, BLOCK_K // 2)  # bytes of one K step
    offs_k = tl.arange(0, BLOCK_K)
    groups = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :],
                    mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        byte = k0 // 2 + offs_b  # byte index within the row: group byte // 16, byte % 16 within it
        wmask = (offs_n[:, None] < N) & (byte[None, :] < K // 2)
        packed = tl.load(blocks_ptr + offs_n[:, None] * (K // 2) + byte[None, :], mask=wmask, other=0)
        packed = packed.to(tl.int32)
        values = tl.join(_e2m1(packed & 15), _e2m1(packed >> 4))  # [BN, BK / 2, 2]: element 2j, 2j + 1
        values = tl.reshape(values, (BLOCK_N, BLOCK_K))
        group = (k0 + offs_k) // 32
        scale = tl.load(scales_ptr + offs_n[:, None] * groups + group[None, :],
                        mask=(offs_n[:, None] < N) & (group[None, :] < groups), other=127)
        w = (values * _e8m0(scale)).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T (+ bias [N]) -> [M, N] in x's dtype; blocks [N, K / 32, 16], scales [N, K / 32]."""
    n, groups = scales.shape
    k = groups * 32
    if x.dim() != 2 or x.shape[1] != k or tuple(blocks.shape) != (n, groups, 16):
        raise ValueError(f"mxfp4 triton linear: x {tuple(x.shape)}, blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit x [M, {k}], blocks [N, {groups}, 16]")
    x, blocks, scales = x.contiguous(), blocks.contiguous(), scales.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _mxfp4_gemm_kernel[grid](x, blocks, scales, bias if bias is not None else y, y, x.shape[0], n, k,
                             HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
