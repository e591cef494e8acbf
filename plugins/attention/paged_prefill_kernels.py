"""Paged prefill attention in Triton: new tokens attending over a cached prefix plus themselves.

Sequences are packed back to back (varlen): sequence ``b`` owns query rows
``cu_query_lens[b] : cu_query_lens[b + 1]``, which are the last ``query_len``
positions of a context of ``seq_len`` keys, so query ``i`` sits at position
``seq_len - query_len + i`` and sees keys up to it (causal, optionally within
a sliding window). Every key — cached or written this step by
``reshape_and_cache`` — is read from the cache through the block table, so a
prefix-cache hit and a chunked prefill are the same case.

One program per (query block, sequence, KV head). Its tile's rows are
``BLOCK_Q`` query tokens x the ``G`` query heads that share the KV head, so
each K/V row is read once for the group (GQA without repeating K/V). Keys are
walked in tiles of ``TILE`` positions up to the last query's position, with
an online softmax. Quantized caches (``k_scale`` / ``v_scale``) are dequantized
per tile in registers, as in ``paged_kernels``. The PyTorch twin is
``paged_ref.paged_prefill_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.paged_kernels import (
    LOG2E,
    TILE_N,
    _attend_tile,
    _dequant_tile,
    _kv_tile_offsets,
    check_cache,
    check_out,
    check_scales,
    dot_precision,
    scale_args,
    window_arg,
)

ROWS = 64  # query rows (tokens x grouped heads) per program


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_query_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    qk_scale, sliding_window, num_queries_per_kv, head_dim,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, TILE: tl.constexpr,
    D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_query_lens_ptr + seq)
    query_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # row r of the tile: token q_block * BLOCK_Q + r // G_PAD, query head r % G_PAD of the group
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q_block * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    row_mask = (tok < query_len) & (g < num_queries_per_kv)
    head = kv_head * num_queries_per_kv + g
    q_pos = context_len + tok
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < head_dim
    io_mask = row_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=io_mask, other=0.0)  # [BLOCK_Q * G_PAD, D]

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    # keys [lo, hi): from the first query's window start to the last query's position
    hi = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    lo = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    for start in range(lo, hi, TILE):
        pos = start + tl.arange(0, TILE)
        valid = pos < hi
        offs = _kv_tile_offsets(table_ptr, stride_btn, pos, valid, kv_head, offs_d,
                                stride_cb, stride_ct, stride_ch, stride_cd, BLOCK_SIZE)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if QUANT:
            k = _dequant_tile(k, k_scale_ptr, table_ptr, stride_btn, pos, valid, kv_head,
                              stride_sb, stride_st, stride_sh, BLOCK_SIZE, q.dtype)
            v = _dequant_tile(v, v_scale_ptr, table_ptr, stride_btn, pos, valid, kv_head,
                              stride_sb, stride_st, stride_sh, BLOCK_SIZE, q.dtype)
        visible = (valid[None, :] & (pos[None, :] <= q_pos[:, None])
                   & (pos[None, :] > q_pos[:, None] - sliding_window))
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                            max_query_len: int | None = None, out: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (sequences back to back), cu_query_lens [B+1] int32, seq_lens [B] int32 -> [T, H, D].

    ``max_query_len`` (host int) spares a device sync; ``out`` (like q) receives the result when given;
    ``k_scale`` / ``v_scale`` ([num_blocks, block_size, Hkv] float32) mark quantized caches.
    """
    quant = check_scales(k_cache, v_cache, k_scale, v_scale, "paged_prefill_attention")
    check_cache(q, k_cache, v_cache, block_tables, seq_lens, "paged_prefill_attention", quant)
    if cu_query_lens.dtype != torch.int32 or cu_query_lens.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"paged_prefill_attention: cu_query_lens must be int32 "
                         f"[B+1={seq_lens.shape[0] + 1}], got {cu_query_lens.dtype} "
                         f"{tuple(cu_query_lens.shape)}")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = check_out(out, q, "paged_prefill_attention")
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, ROWS // g_pad)
    scale_ptrs, scale_strides = scale_args(k_cache, k_scale, v_scale)
    _paged_prefill_kernel[(triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, out, *scale_ptrs,
        scale * LOG2E, window_arg(sliding_window), group, head_dim,
        *q.stride(), *k_cache.stride(), *block_tables.stride(), *out.stride(), *scale_strides,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, G_PAD=g_pad, TILE=TILE_N,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), DOT_PRECISION=dot_precision(q.dtype),
        QUANT=quant)
    return out
