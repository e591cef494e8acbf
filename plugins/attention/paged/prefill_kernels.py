"""Paged prefill attention in Triton: new tokens attending over a cached prefix plus themselves.

Sequences are packed back to back (varlen): sequence ``b`` owns query rows
``cu_query_lens[b] : cu_query_lens[b + 1]``, which are the last ``query_len``
positions of a context of ``seq_len`` keys, so query ``i`` sits at position
``seq_len - query_len + i`` and sees keys up to it (causal, optionally within
a sliding window). Every key — cached or written this step by
``reshape_and_cache`` — is read from the cache through the block table, so a
prefix-cache hit and a chunked prefill are the same case.

One program per (query block, sequence, KV head). Its tile's rows are
``BLOCK_Q`` query tokens x the ``G`` query heads that share the KV head (``ROWS``
in all, from the per-architecture ``PREFILL_TABLE``), so
each K/V row is read once for the group (GQA without repeating K/V). Keys are
walked in ``TILE``-aligned tiles from the first query's window to the last
query's position by ``attn_ops.attend_tiles``, as in every kernel of both backends. ``flash`` keeps its own prefill kernel (``flash_prefill_kernels``):
one query head per program, with masked and unmasked tile ranges. The
PyTorch reference is ``prefill_ref.prefill_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.attn_ops import (
    LOG2E,
    arch_entry,
    attend_tiles,
    check_block_tables,
    check_kv,
    check_query,
    dot_precision,
    feature_args,
    fold_sinks,
    head_dim_pad,
    output_for,
    softmax_state,
    window_arg,
)
from lmplug_attention.kv_ops import check_scales, quant_args

from lmplug.kit.devices import capability

# (ROWS: query rows, tokens x grouped heads, per program; TILE: context positions per loop
# iteration; num_warps; num_stages) per architecture (``attn_ops.arch_entry``), by input width
# ("16": fp16 / bf16, "32": fp32) and padded head dim (the first row with d_pad <= its bound).
# Chosen by compiling each entry for its target (Triton 3.9, registers / spills / shared memory,
# over plain, int8 and fp8 caches):
# - sm_80 (A100): the 64 x 64 tile spills from d128 on (72 B per thread; 316 B and 104 KiB of
#   shared memory at d256), and with fp8 KV at d64; 32-key tiles do not, with 8 warps and two
#   stages at d256 (68 KiB: sm_86 / sm_89 can launch it too).
# - sm_90 (H100): 64 x 64 with 4 warps fits up to d128; at d256 it spills (304 B) and takes
#   160 KiB of shared memory: 32-key tiles, 8 warps and two stages (96 KiB, no spills).
# - fp32 (exact ``ieee`` dots): 32 rows with 8 warps, 16-key tiles at d256 (66 KiB).
# - None: the interpreter (tests) and the fallback where no GPU is known.
_FP32 = ((128, (32, 32, 8, 2)), (256, (32, 16, 8, 2)))
PREFILL_TABLE: dict[tuple[int, int] | None, dict[str, tuple]] = {
    None: {"16": ((256, (64, 64, 4, 3)),), "32": ((256, (64, 64, 4, 3)),)},
    (8, 0): {"16": ((128, (64, 32, 4, 3)), (256, (64, 32, 8, 2))), "32": _FP32},
    (9, 0): {"16": ((128, (64, 64, 4, 3)), (256, (64, 32, 8, 2))), "32": _FP32},
}


def prefill_config(d_pad: int, dtype: torch.dtype, cap: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """(ROWS, TILE, num_warps, num_stages) for a GPU of capability ``cap``: ``PREFILL_TABLE``."""
    rows = arch_entry(PREFILL_TABLE, cap)["32" if dtype == torch.float32 else "16"]
    return next(config for bound, config in rows if d_pad <= bound)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_query_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr,
    qk_scale, softcap, sliding_window, num_queries_per_kv, head_dim,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, TILE: tl.constexpr,
    D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
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

    acc, l_i, m_i = softmax_state(BLOCK_Q * G_PAD, D_PAD)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    # keys [lo, hi): from the first query's window start to the last query's position
    hi = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    lo = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    acc, l_i, m_i = attend_tiles(
        acc, l_i, m_i, q, q_pos, lo // TILE, tl.cdiv(hi, TILE), lo, hi, sliding_window, qk_scale, softcap,
        k_cache_ptr, v_cache_ptr, table_ptr, stride_btn, 0, kv_head, offs_d, d_mask,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,
        TILE, BLOCK_SIZE, True, True, DOT_PRECISION, QUANT, SOFTCAP)
    l_i = fold_sinks(l_i, m_i, sinks_ptr, head, row_mask, SINKS)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           cu_query_lens: torch.Tensor, seq_lens: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None, what: str) -> bool:
    check_query(q, what)
    quant = check_scales(k_cache, v_cache, k_scale, v_scale, what)
    check_kv(q, k_cache, v_cache, what, "k_cache and v_cache", quant)
    check_block_tables(block_tables, seq_lens, what)
    if k_cache.dim() != 4:
        raise ValueError(f"{what}: the caches must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)}")
    if cu_query_lens.dtype != torch.int32 or cu_query_lens.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"{what}: cu_query_lens must be int32 [B+1={seq_lens.shape[0] + 1}], got "
                         f"{cu_query_lens.dtype} {tuple(cu_query_lens.shape)}")
    return quant


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                            max_query_len: int | None = None, out: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (sequences back to back), cu_query_lens [B+1] int32, seq_lens [B] int32 -> [T, H, D].

    ``max_query_len`` (host int) spares a device sync; ``out`` (like q) receives the result when given;
    ``k_scale`` / ``v_scale`` ([num_blocks, block_size, Hkv] float32) mark quantized caches;
    ``softcap``: scores soft-capped, ``softcap * tanh(s / softcap)``; ``sinks`` [H]: one logit per
    query head joined to every row's softmax denominator (attention sinks).
    """
    what = "paged_prefill_attention"
    _check(q, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, k_scale, v_scale, what)
    window = window_arg(sliding_window, what)
    out = output_for(q, out, what)
    _, num_heads, head_dim = q.shape
    cap, sinks, capped, sunk = feature_args(softcap, sinks, num_heads, q.device, what)
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    d_pad = head_dim_pad(head_dim)
    rows, tile, num_warps, num_stages = prefill_config(d_pad, q.dtype, capability(q.device))
    block_q = max(1, rows // g_pad)
    k_cache, v_cache, scale_ptrs, scale_strides, quant = quant_args(k_cache, v_cache, k_scale, v_scale)
    _paged_prefill_kernel[(triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, out, *scale_ptrs, sinks if sunk else q,
        scale * LOG2E, cap, window, group, head_dim,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *scale_strides, BLOCK_SIZE=block_size, BLOCK_Q=block_q, G_PAD=g_pad, TILE=tile,
        D_PAD=d_pad, DOT_PRECISION=dot_precision(q.dtype), QUANT=quant, SOFTCAP=capped, SINKS=sunk,
        num_warps=num_warps,
        num_stages=num_stages)
    return out
