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

Scales and zeros: with contiguous groups (no act-order; the caller passes
``group_size``) every K step lies inside one group (``BLOCK_K`` divides the
group), so a step loads one row of ``BLOCK_N`` scales and zeros; with
act-order (``group_size`` None) each input row has its own group and the step
gathers ``[BLOCK_K, BLOCK_N]`` of them through ``g_idx``.

Launches come from tables per architecture and M bucket (``gemm_config``,
``gemv_config``; ``lmplug.kit.devices.capability``): M <= 16 takes
16-row, wide-K tiles over N, prefill takes 128 x 128 tiles with 8 warps.
The entries are sized by the register and shared-memory budgets of sm_80
and sm_90 and compile-checked for spills there, not tuned by measurement.
Row offsets are 64-bit (``M x K`` and ``M x N`` can pass 2^31).

GPTQ v1 zeros are converted to v2 at load time, so no ``+1`` happens here.
The PyTorch twins are ``lmplug_quant.gptq.gptq_dequantize`` and
``lmplug_quant.awq.awq_dequantize`` followed by a matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_quant.common import LaunchConfig, arch_key, m_bucket

from lmplug.kit.devices import capability


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
def _dequantized_step(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, offs_k, k_mask, offs_n, n_mask, n_shifts,
                      stride_qwr, stride_qwc, stride_qzr, stride_qzc, stride_sr, stride_sc,
                      BITS: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """``W[k0 + offs_k, offs_n]`` in float32, ``[BLOCK_K, BLOCK_N]``."""
    PACK: tl.constexpr = 32 // BITS
    rows = k0 + offs_k
    w_mask = k_mask[:, None] & n_mask[None, :]
    if AWQ_ORDER:
        w_ptrs = qw_ptr + rows[:, None] * stride_qwr + (offs_n // PACK)[None, :] * stride_qwc
        q = _unpack(tl.load(w_ptrs, mask=w_mask, other=0), n_shifts[None, :], BITS)
    else:
        w_ptrs = qw_ptr + (rows // PACK)[:, None] * stride_qwr + offs_n[None, :] * stride_qwc
        q = _unpack(tl.load(w_ptrs, mask=w_mask, other=0), ((rows % PACK) * BITS)[:, None], BITS)
    if GROUP_SIZE > 0:  # the step lies in one group: one row of zeros and scales
        g = k0 // GROUP_SIZE
        z = _unpack(tl.load(qz_ptr + g * stride_qzr + (offs_n // PACK) * stride_qzc, mask=n_mask, other=0),
                    n_shifts, BITS)[None, :]
        s = tl.load(s_ptr + g * stride_sr + offs_n * stride_sc, mask=n_mask, other=0.0)[None, :]
    else:  # act-order: each input row names its group
        groups = tl.load(g_ptr + rows, mask=k_mask, other=0)[:, None]  # [BK, 1]
        z_ptrs = qz_ptr + groups * stride_qzr + (offs_n // PACK)[None, :] * stride_qzc
        z = _unpack(tl.load(z_ptrs, mask=w_mask, other=0), n_shifts[None, :], BITS)
        s = tl.load(s_ptr + groups * stride_sr + offs_n[None, :] * stride_sc, mask=w_mask, other=0.0)
    return (q - z).to(tl.float32) * s


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qwr, stride_qwc, stride_qzr, stride_qzc,
    stride_sr, stride_sc, stride_ym, stride_yn,
    BITS: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """y[m-tile, n-tile] = x[m-tile, :] @ dequantize(W)[:, n-tile]."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 16)  # tl.dot's minimum tile
    tl.static_assert(not AWQ_ORDER or BITS == 4)  # AWQ's interleave is defined for 4 bits
    tl.static_assert(GROUP_SIZE % BLOCK_K == 0)  # a K step never crosses a group
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    x_ptr += row0.to(tl.int64) * stride_xm  # 64-bit row bases; in-tile offsets stay 32-bit
    y_ptr += row0.to(tl.int64) * stride_ym
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M - row0
    n_mask = offs_n < N
    n_shifts = _column_shifts(offs_n, BITS, AWQ_ORDER)  # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w = _dequantized_step(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, offs_k, k_mask, offs_n, n_mask, n_shifts,
                              stride_qwr, stride_qwc, stride_qzr, stride_qzc, stride_sr, stride_sc,
                              BITS, AWQ_ORDER, GROUP_SIZE)
        acc = tl.dot(a, w.to(x_ptr.dtype.element_ty), acc, input_precision=PRECISION)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, part_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qwr, stride_qwc, stride_qzr, stride_qzc,
    stride_sr, stride_sc, stride_ps, stride_pm, stride_pn,
    BITS: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Decode (M <= BLOCK_M tokens), split-K: program (n-tile, s) sums inputs
    [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) into ``part[s, :M, n-tile]``, with broadcast
    multiply-adds in float32 instead of ``tl.dot`` (whose 16-row minimum tile would waste most of
    its work on one token); the host sums the splits."""
    tl.static_assert(not AWQ_ORDER or BITS == 4)
    tl.static_assert(GROUP_SIZE % BLOCK_K == 0)  # K_PER_SPLIT is a multiple of BLOCK_K
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    n_shifts = _column_shifts(offs_n, BITS, AWQ_ORDER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        w = _dequantized_step(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, offs_k, k_mask, offs_n, n_mask, n_shifts,
                              stride_qwr, stride_qwc, stride_qzr, stride_qzc, stride_sr, stride_sc,
                              BITS, AWQ_ORDER, GROUP_SIZE)  # [BK, BN]
        acc += tl.sum(a[:, :, None] * w[None, :, :], axis=1)
    p_ptrs = part_ptr + pid_s * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
    tl.store(p_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


# -- launch tables -----------------------------------------------------------------------------------

GEMV_MAX_M = 4  # decode batches up to this many tokens take the split-K GEMV

# tiled GEMM, per architecture and M bucket (common.m_bucket): (block_m, block_n, block_k, warps,
# stages). The dequantized [BK, BN] step lives in registers next to the fp32 accumulator, so tiles
# are sized to stay spill-free (checked with ptxas for sm_80 and sm_90). The dequantized step also
# passes through shared memory: a 16 x 64 x 128 step takes ~100 KiB in 3 stages with act-order,
# more than sm_86/sm_89 have, so sm80's decode step is 64 wide.
GEMM_TABLE: dict[str, dict[int, tuple[int, int, int, int, int]]] = {
    "sm80": {16: (16, 64, 64, 4, 3), 64: (64, 64, 64, 4, 3), 128: (128, 128, 32, 8, 3)},
    "sm90": {16: (16, 64, 128, 4, 4), 64: (64, 128, 64, 4, 4), 128: (128, 128, 64, 8, 4)},
}
# split-K GEMV, per architecture and rows (1, 2 or 4): (block_n, block_k, warps); the broadcast
# product holds BM x BK x BN float32 values, kept at 8K for 4 warps (64 a thread)
GEMV_TABLE: dict[str, dict[int, tuple[int, int, int]]] = {
    "sm80": {1: (64, 128, 4), 2: (64, 64, 4), 4: (64, 32, 4)},
    "sm90": {1: (64, 128, 4), 2: (64, 64, 4), 4: (64, 32, 4)},
}
# programs a GEMV launch aims for (split-K fills what the N tiles leave): ~4 per SM of an A100
# (108 SMs) and of an H100 (132 SMs)
GEMV_PROGRAMS = {None: 256, "sm80": 432, "sm90": 528}


def _group_block_k(group_size: int | None, block_k: int, smallest: int) -> tuple[int, int]:
    """(GROUP_SIZE, BLOCK_K) for the kernel: BLOCK_K shrunk to divide the group so that a step lies
    in one group; GROUP_SIZE 0 (per-row gather through g_idx) for act-order or a group that no
    power of two >= ``smallest`` divides."""
    if not group_size:
        return 0, block_k
    step = min(block_k, group_size & -group_size)  # the largest power of two dividing the group
    return (group_size, step) if step >= smallest else (0, block_k)


def gemm_config(cap: tuple[int, int] | None, m: int, n: int, k: int, group_size: int | None = None,
                fp32: bool = False) -> tuple[LaunchConfig, int]:
    """(launch, GROUP_SIZE) of the tiled GEMM for ``[M, K] x [K, N]`` on ``cap`` (None: the
    interpreter's small tiles). ``fp32``: float32 activations, whose exact (``ieee``) dot runs on
    FMA units with both operands in registers: the table's tiles spill there, so float32 (the
    reference precision, not a serving one) keeps the small tiles on every architecture."""
    arch = arch_key(cap)
    if arch is None or fp32:
        bm, bn, bk, warps, stages = 16 if m <= 16 else 32 if m <= 32 else 64, 32, 32, 4, 3
    else:
        bm, bn, bk, warps, stages = GEMM_TABLE[arch][m_bucket(m) if m > 1 else 16]
    group, bk = _group_block_k(group_size, bk, 16)
    return LaunchConfig(bm, bn, bk, warps, stages), group


def gemv_config(cap: tuple[int, int] | None, m: int, n: int, k: int, group_size: int | None = None,
                split_k: int | None = None) -> tuple[LaunchConfig, int]:
    """(launch, GROUP_SIZE) of the split-K GEMV for ``m <= GEMV_MAX_M`` rows; ``split_k`` None:
    enough splits to reach the architecture's program count."""
    arch = arch_key(cap)
    bm = triton.next_power_of_2(m)
    bn, bk, warps = (64, 32, 4) if arch is None else GEMV_TABLE[arch][bm]
    group, bk = _group_block_k(group_size, bk, 16)
    n_tiles = triton.cdiv(n, bn)
    k_blocks = triton.cdiv(k, bk)
    if split_k is None:
        split_k = max(1, min(k_blocks, triton.cdiv(GEMV_PROGRAMS[arch], n_tiles)))
    k_per_split = triton.cdiv(k_blocks, split_k) * bk
    return LaunchConfig(bm, bn, bk, warps, 1, triton.cdiv(k, k_per_split)), group


def contiguous_group_size(g_idx: torch.Tensor, num_groups: int) -> int | None:
    """The group size when input row ``k`` is in group ``k // size`` (no act-order), else None.
    Reads ``g_idx`` (a device sync): call it once, at load time, and pass ``group_size``."""
    k = g_idx.shape[0]
    if num_groups <= 0 or k % num_groups:
        return None
    size = k // num_groups
    want = torch.arange(k, device=g_idx.device) // size
    return size if torch.equal(g_idx.long(), want) else None


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


def _check_group_size(group_size: int | None, k: int, groups: int) -> None:
    if group_size is not None and (group_size <= 0 or group_size * groups != k):
        raise ValueError(f"w4a16_gemm: group_size {group_size} does not cut {k} inputs into "
                         f"{groups} groups")


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor, *, bits: int = 4, awq_order: bool = False,
               split_k: int | None = None, group_size: int | None = None) -> torch.Tensor:
    """The decode path of ``w4a16_gemm`` (``M <= GEMV_MAX_M``): split-K over ``split_k`` programs per
    output tile (default: from the launch table), partial sums added here."""
    m, n, k = _check_args(x, qweight, qzeros, scales, g_idx, bits, awq_order)
    _check_group_size(group_size, k, scales.shape[0])
    if m > GEMV_MAX_M:
        raise ValueError(f"w4a16_gemv: {m} rows; the GEMV path takes at most {GEMV_MAX_M}")
    cfg, group = gemv_config(capability(x.device), m, n, k, group_size, split_k)
    parts = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    _w4a16_gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, qweight, qzeros, scales, g_idx, parts, m, n, k, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        qzeros.stride(0), qzeros.stride(1), scales.stride(0), scales.stride(1),
        parts.stride(0), parts.stride(1), parts.stride(2),
        BITS=bits, AWQ_ORDER=awq_order, GROUP_SIZE=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return parts.sum(0).to(x.dtype)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor, *, bits: int = 4, awq_order: bool = False,
               group_size: int | None = None) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` with W dequantized on the fly; returns ``[M, N]`` in ``x.dtype``.
    Decode batches (``M <= GEMV_MAX_M``) take the split-K GEMV. ``group_size``: the weights'
    contiguous group size (``contiguous_group_size``), which lets a K step load one row of scales;
    None: groups are read through ``g_idx`` row by row (act-order)."""
    m, n, k = _check_args(x, qweight, qzeros, scales, g_idx, bits, awq_order)
    _check_group_size(group_size, k, scales.shape[0])
    if m <= GEMV_MAX_M:
        return w4a16_gemv(x, qweight, qzeros, scales, g_idx, bits=bits, awq_order=awq_order,
                          group_size=group_size)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg, group = gemm_config(capability(x.device), m, n, k, group_size, fp32=x.dtype == torch.float32)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _w4a16_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx, y, m, n, k,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        qzeros.stride(0), qzeros.stride(1), scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1),
        BITS=bits, AWQ_ORDER=awq_order, GROUP_SIZE=group,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
