"""Flash decoding in Triton: one new token per sequence over its cached context, split-K for long ones.

What: query ``b`` (``q [B, H, D]``) sits at position ``seq_lens[b] - 1`` and
attends over the keys ``[max(seq_len - window, 0), seq_len)`` that the block
tables point at (contiguous or paged layout, as in ``flash_kernels``).

Why this shape: decode is bound by reading K/V, not by arithmetic. One
program per (sequence, KV head) loads the ``G`` query heads that share the KV
head as the rows of one tile, so every K/V row is read once for the whole
group (GQA without repeating K/V). With few sequences x KV heads those
programs alone leave most of the GPU idle on a long context, so the context
(only the part inside the window) is cut into ``num_splits`` partitions
computed in parallel: each writes its normalised partial output with its
running max and sum (fp32), and ``_flash_decode_reduce_kernel`` merges them
with weights ``exp2(m_p - max_p m_p) * l_p`` (FlashDecoding). The split count
comes from the context length and how many programs the batch already gives
(``plan_decode``). The PyTorch twin is ``flash_ref.decode_with_kvcache_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.flash_kernels import (
    LOG2E,
    _dequant_kv_tile,
    _kv_slots,
    _load_kv_tile,
    _online_softmax_update,
    check_block_tables,
    check_kv,
    check_power_of_two,
    check_query,
    dot_precision,
    head_dim_pad,
    output_for,
    window_arg,
)
from lmplug_attention.paged_kernels import check_scales, scale_args

MIN_PARTITION = 256  # keys per split below which a split costs more than it saves
MAX_SPLITS = 64


@triton.jit
def _flash_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, window, num_queries_per_kv, partition_size,
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

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for start in range(part_lo, part_hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos >= lo) & (pos < seq_len)
        block, offset = _kv_slots(table_ptr, stride_btn, start, pos, valid, 0, BLOCK_SIZE, BLOCK_N, True)
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block, offset, kv_head, offs_d,
                             valid[:, None] & d_mask[None, :],
                             stride_kb, stride_kt, stride_kh, stride_kd,
                             stride_vb, stride_vt, stride_vh, stride_vd)
        if QUANT:
            k, v = _dequant_kv_tile(k, v, k_scale_ptr, v_scale_ptr, block, offset, kv_head, valid,
                                    stride_sb, stride_st, stride_sh, q.dtype)
        m_i, l_i, acc = _online_softmax_update(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale,
                                               True, PRECISION)

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
def _flash_decode_reduce_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_mb, stride_mh, stride_ms,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    """Merge the partitions of one (sequence, query head)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    stat = seq * stride_mb + head * stride_mh + offs_s * stride_ms
    m = tl.load(part_max_ptr + stat, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + stat, mask=s_mask, other=0.0)
    # partition 0 holds the window's first key, so the max is finite
    weight = tl.math.exp2(m - tl.max(m, 0)) * l
    part = seq * stride_pb + head * stride_ph + offs_s * stride_ps
    o = tl.load(part_out_ptr + part[:, None] + offs_d[None, :] * stride_pd,
                mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# -- Python wrappers ------------------------------------------------------------------------------------


def decode_block_n(head_dim: int) -> int:
    return 64 if head_dim_pad(head_dim) <= 128 else 32


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # plan as for an H100 when there is none (interpreter runs)


def choose_num_splits(num_seqs: int, num_kv_heads: int, span: int, sms: int) -> int:
    """Split only while (sequence, KV head) programs leave SMs idle, keeping >= MIN_PARTITION keys each."""
    programs = num_seqs * num_kv_heads
    if programs >= sms or span < 2 * MIN_PARTITION:
        return 1
    return max(1, min(span // MIN_PARTITION, triton.cdiv(2 * sms, programs), MAX_SPLITS))


def plan_decode(num_seqs: int, num_kv_heads: int, max_seq_len: int, sliding_window: int | None,
                block_n: int, num_splits: int | None, sms: int) -> tuple[int, int]:
    """(splits, partition_size in keys, a multiple of ``block_n``) covering the longest window."""
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_n - 1)
    span = max(span, 1)
    wanted = num_splits or choose_num_splits(num_seqs, num_kv_heads, span, sms)
    partition = triton.cdiv(triton.cdiv(span, wanted), block_n) * block_n
    return triton.cdiv(span, partition), partition


def flash_decode_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                              sliding_window: int | None = None, max_seq_len: int | None = None,
                              num_splits: int | None = None, out: torch.Tensor | None = None,
                              block_n: int | None = None, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its cache: q [B, H, D] -> [B, H, D].

    k_cache, v_cache: [num_blocks, block_size, Hkv, D] holding each sequence's
    ``seq_lens[b]`` (int32 [B], each >= 1) keys at the blocks listed in
    ``block_tables[b]`` (int32 [B, max_blocks]). ``num_splits`` forces the
    number of split-K partitions (``None``: chosen from context length and
    batch size; 1: no split); ``max_seq_len`` (a host int) spares a sync. ``k_scale`` /
    ``v_scale`` ([num_blocks, block_size, Hkv] float32) mark int8 / float8_e4m3fn caches.
    """
    what = "flash_decode_with_kvcache"
    check_query(q, what)
    quant = check_scales(k_cache, v_cache, k_scale, v_scale, what)
    group = check_kv(q, k_cache, v_cache, what, "k_cache and v_cache", quant)
    check_block_tables(block_tables, seq_lens, what)
    if k_cache.dim() != 4 or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{what}: need caches [num_blocks, block_size, Hkv, D] and one seq_len per query; "
                         f"got caches {tuple(k_cache.shape)}, q {tuple(q.shape)}, seq_lens {tuple(seq_lens.shape)}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{what}: num_splits must be None or in [1, {MAX_SPLITS}], got {num_splits}")
    window = window_arg(sliding_window, what)
    out = output_for(q, out, what)
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    bn = block_n or decode_block_n(head_dim)
    check_power_of_two(bn, "block_n", what)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    splits, partition = plan_decode(batch, k_cache.shape[2], max_seq_len, sliding_window, bn, num_splits,
                                    num_sms(q.device))
    d_pad = head_dim_pad(head_dim)
    meta = {"HEAD_DIM": head_dim, "D_PAD": d_pad, "G_PAD": max(16, triton.next_power_of_2(group)),
            "BLOCK_N": bn, "BLOCK_SIZE": k_cache.shape[1], "PRECISION": dot_precision(q.dtype),
            "QUANT": quant, "num_warps": 4}
    args = (q, k_cache, v_cache, block_tables, seq_lens)
    scale_ptrs, scale_strides = scale_args(k_cache, k_scale, v_scale)
    scalars = (scale * LOG2E, window, group, partition,
               *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride())
    grid = (batch, k_cache.shape[2], splits)
    if splits == 1:
        _flash_decode_kernel[grid](*args, out, out, out, out, *scale_ptrs, *scalars, *out.stride(),
                                   0, 0, 0, 0, 0, 0, 0, *scale_strides, SPLIT=False, **meta)
        return out
    part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _flash_decode_kernel[grid](*args, out, part_out, part_max, part_sum, *scale_ptrs, *scalars,
                               *out.stride(), *part_out.stride(), *part_max.stride(), *scale_strides,
                               SPLIT=True, **meta)
    _flash_decode_reduce_kernel[(batch, num_heads)](
        part_out, part_max, part_sum, out, splits, *part_out.stride(), *part_max.stride(), *out.stride(),
        HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out
