"""Split-K decode in Triton: one new token per sequence over its cached context (flash decoding).

What: query ``b`` (``q [B, H, D]``) sits at position ``seq_lens[b] - 1`` and
attends over the keys ``[max(seq_len - window, 0), seq_len)`` that the block
tables point at (contiguous or paged layout, ``kv_ops``). The decode of both
``flash`` (``flash_decode_kernels.flash_decode_with_kvcache``) and ``paged``
(``paged_kernels.paged_decode_attention``) is this kernel; the two wrappers
differ only in how a caller asks for a split (a count, or a partition size).

Why this shape: decode is bound by reading K/V, not by arithmetic. One
program per (sequence, KV head) loads the ``G`` query heads that share the KV
head as the rows of one tile, so every K/V row is read once for the whole
group (GQA without repeating K/V). With few sequences x KV heads those
programs alone leave most of the GPU idle on a long context, so the context
(only the part inside the window) is cut into ``splits`` partitions computed
in parallel: each writes its normalised partial output with its running max
and sum (fp32), and ``_decode_reduce_kernel`` merges them with weights
``exp2(m_p - max_p m_p) * l_p``. The split count comes from the context
length and how many programs the batch already gives (``plan_decode``).
The PyTorch reference is ``decode_ref.decode_attention``.

Launch configuration: one serves sm_80 and sm_90 (``BLOCK_N`` 64 up to head dim
128, 32 above; 4 warps): compiled for both, no head dim from 64 to 256 spills,
quantized KV included, and every program fits 42 KiB of shared memory. The
architecture enters through the SM count the split is planned for (``num_sms``).

Compilations: the context length reaches the kernels only as runtime integers,
which Triton specializes on divisibility by 16 (partition sizes are multiples of
``BLOCK_N`` already). The split count enters the decode kernel as ``SPLIT`` (two
values) and the reduce as ``S_TILE`` (``attn_ops.bucket``: at most 6 values), so
a serving run compiles each at most that many times per head dim and dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.attn_ops import (
    LOG2E,
    arch_entry,
    attend_tiles,
    bucket,
    check_block_tables,
    check_kv,
    check_query,
    dot_precision,
    feature_args,
    fold_sinks,
    head_dim_pad,
    softmax_state,
)
from lmplug_attention.kv_ops import check_scales, quant_args

from lmplug.kit.devices import capability

MIN_PARTITION = 256  # keys per split below which a split costs more than it saves
MAX_SPLITS = 64
# SMs per architecture where no device can be asked: the compile check (``target_capability``)
# and the interpreter (None: plan as an H100 SXM)
SM_COUNTS = {None: 132, (8, 0): 108, (9, 0): 132}
REDUCE_TILE_ELEMENTS = 8192  # S_TILE x D_PAD fp32 partial outputs per reduce step: 64 per thread


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    qk_scale, softcap, window, num_queries_per_kv, partition_size,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_mb, stride_mh, stride_ms,
    stride_sb, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)
    # partitions tile the window from its first BLOCK_N-aligned position, so none is spent before it
    part_lo = (lo // BLOCK_N) * BLOCK_N + split * partition_size
    part_hi = tl.minimum(part_lo + partition_size, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * num_queries_per_kv + offs_g
    io_mask = (offs_g < num_queries_per_kv)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=io_mask, other=0.0)  # [G_PAD, D_PAD]

    acc, l_i, m_i = softmax_state(G_PAD, D_PAD)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    q_pos = tl.zeros([G_PAD], tl.int32) + seq_len - 1  # every row is the sequence's last token
    acc, l_i, m_i = attend_tiles(
        acc, l_i, m_i, q, q_pos, part_lo // BLOCK_N, tl.cdiv(part_hi, BLOCK_N), lo, part_hi, window, qk_scale,
        softcap,
        k_cache_ptr, v_cache_ptr, table_ptr, stride_btn, 0, kv_head, offs_d, d_mask,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,
        BLOCK_N, BLOCK_SIZE, True, True, PRECISION, QUANT, SOFTCAP)
    if not SPLIT:  # split, the reduce joins the sinks (here, a split == 0 mask spills on sm_90)
        l_i = fold_sinks(l_i, m_i, sinks_ptr, heads, offs_g < num_queries_per_kv, SINKS)

    # an empty partition (a sequence shorter than the longest) keeps l = 0, m = -inf: weight 0
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        part = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + offs_d[None, :] * stride_pd, out, mask=io_mask)
        stat = seq.to(tl.int64) * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(part_max_ptr + stat, m_i, mask=offs_g < num_queries_per_kv)
        tl.store(part_sum_ptr + stat, l_i, mask=offs_g < num_queries_per_kv)
    else:
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, sinks_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_mb, stride_mh, stride_ms,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_TILE: tl.constexpr, SINKS: tl.constexpr,
):
    """Merge the partitions of one (sequence, query head), ``S_TILE`` partitions at a time; with
    ``SINKS``, the head's sink joins the merged denominator (``attn_ops.fold_sinks``)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    m_run = tl.full([], float("-inf"), tl.float32)
    den = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, num_splits, S_TILE):
        offs_s = s0 + tl.arange(0, S_TILE)
        s_mask = offs_s < num_splits
        stat = seq * stride_mb + head * stride_mh + offs_s * stride_ms
        m = tl.load(part_max_ptr + stat, mask=s_mask, other=float("-inf"))
        l = tl.load(part_sum_ptr + stat, mask=s_mask, other=0.0)
        part = seq * stride_pb + head * stride_ph + offs_s * stride_ps
        o = tl.load(part_out_ptr + part[:, None] + offs_d[None, :] * stride_pd,
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        # partition 0 holds the window's first key, so the first tile's max is finite
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.math.exp2(m_run - m_new)
        weight = tl.math.exp2(m - m_new) * l
        den = den * alpha + tl.sum(weight, 0)
        acc = acc * alpha + tl.sum(weight[:, None] * o, 0)
        m_run = m_new
    den = fold_sinks(den, m_run, sinks_ptr, head, True, SINKS)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             (acc / den).to(out_ptr.dtype.element_ty), mask=d_mask)


# -- planning and launching ---------------------------------------------------------------------------


def decode_block_n(head_dim: int) -> int:
    return 64 if head_dim_pad(head_dim) <= 128 else 32


def num_sms(device: torch.device) -> int:
    """The SMs a split-K plan fills: a CUDA device's own count; else that of the architecture
    ``capability`` names (``SM_COUNTS``: A100 108, H100 132), so the compile check plans
    for sm_80 / sm_90 exactly as those GPUs do."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return arch_entry(SM_COUNTS, capability(device))


def choose_num_splits(num_seqs: int, num_kv_heads: int, span: int, sms: int) -> int:
    """Split only while (sequence, KV head) programs leave SMs idle, keeping >= MIN_PARTITION keys each."""
    programs = num_seqs * num_kv_heads
    if programs >= sms or span < 2 * MIN_PARTITION:
        return 1
    return max(1, min(span // MIN_PARTITION, triton.cdiv(2 * sms, programs), MAX_SPLITS))


def decode_span(max_seq_len: int, sliding_window: int | None, block_n: int) -> int:
    """Keys the longest window covers from its first ``block_n``-aligned position."""
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_n - 1)
    return max(span, 1)


def plan_decode(num_seqs: int, num_kv_heads: int, max_seq_len: int, sliding_window: int | None,
                block_n: int, num_splits: int | None, sms: int) -> tuple[int, int]:
    """(splits, partition_size in keys, a multiple of ``block_n``) covering the longest window."""
    span = decode_span(max_seq_len, sliding_window, block_n)
    wanted = num_splits or choose_num_splits(num_seqs, num_kv_heads, span, sms)
    partition = triton.cdiv(triton.cdiv(span, wanted), block_n) * block_n
    return triton.cdiv(span, partition), partition


def check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 what: str) -> bool:
    """Clear errors for arguments the decode kernel cannot take; returns whether KV is quantized."""
    check_query(q, what)
    quant = check_scales(k_cache, v_cache, k_scale, v_scale, what)
    check_kv(q, k_cache, v_cache, what, "k_cache and v_cache", quant)
    check_block_tables(block_tables, seq_lens, what)
    if k_cache.dim() != 4 or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{what}: need caches [num_blocks, block_size, Hkv, D] and one seq_len per query; "
                         f"got caches {tuple(k_cache.shape)}, q {tuple(q.shape)}, seq_lens {tuple(seq_lens.shape)}")
    return quant


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, window: int, splits: int, partition: int,
                  block_n: int, out: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel (and the reduce when ``splits > 1``) on checked arguments into ``out``;
    scores soft-capped at ``softcap``, ``sinks`` [H] (one logit per query head) in every row's
    softmax denominator, where given (``attn_ops.feature_args`` checks them)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    d_pad = head_dim_pad(head_dim)
    cap, sinks, capped, sunk = feature_args(softcap, sinks, num_heads, q.device, "decode attention")
    k_cache, v_cache, scale_ptrs, scale_strides, quant = quant_args(k_cache, v_cache, k_scale, v_scale)
    meta = {"HEAD_DIM": head_dim, "D_PAD": d_pad, "G_PAD": max(16, triton.next_power_of_2(group)),
            "BLOCK_N": block_n, "BLOCK_SIZE": k_cache.shape[1], "PRECISION": dot_precision(q.dtype),
            "QUANT": quant, "SOFTCAP": capped, "SINKS": sunk, "num_warps": 4}
    args = (q, k_cache, v_cache, block_tables, seq_lens)
    sink_ptr = sinks if sunk else q
    scalars = (scale * LOG2E, cap, window, group, partition,
               *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride())
    grid = (batch, num_kv_heads, splits)
    if splits == 1:
        _decode_kernel[grid](*args, out, out, out, out, *scale_ptrs, sink_ptr, *scalars, *out.stride(),
                             0, 0, 0, 0, 0, 0, 0, *scale_strides, SPLIT=False, **meta)
        return out
    part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _decode_kernel[grid](*args, out, part_out, part_max, part_sum, *scale_ptrs, sink_ptr, *scalars,
                         *out.stride(), *part_out.stride(), *part_max.stride(), *scale_strides,
                         SPLIT=True, **meta)
    return reduce_partitions(part_out, part_max, part_sum, out, sinks if sunk else None)


def reduce_partitions(part_out: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                      out: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge split-K partials into ``out`` [B, H, D]: part_out [B, H, S, D] (each partition's
    normalised output, fp32), part_max / part_sum [B, H, S] (its running max, base 2, and sum);
    ``sinks`` (float32 [H]) joined to each head's denominator once. Partition 0 of every row must
    hold a key. Shared by this decode and the MLA decode."""
    batch, num_heads, splits, head_dim = part_out.shape
    d_pad = head_dim_pad(head_dim)
    # S_TILE partitions per step, bucketed (<= 6 values): a bounded number of compilations
    s_tile = bucket(splits, 2, max(2, min(MAX_SPLITS, REDUCE_TILE_ELEMENTS // d_pad)))
    _decode_reduce_kernel[(batch, num_heads)](
        part_out, part_max, part_sum, out, out if sinks is None else sinks, splits, *part_out.stride(),
        *part_max.stride(), *out.stride(), HEAD_DIM=head_dim, D_PAD=d_pad, S_TILE=s_tile, SINKS=sinks is not None,
        num_warps=4)
    return out

