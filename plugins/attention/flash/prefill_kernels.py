"""FlashAttention prefill in Triton: packed variable-length sequences, causal, GQA, sliding window.

What: sequence ``b`` owns query rows ``cu_seqlens[b] : cu_seqlens[b + 1]``;
they are the last ``query_len`` positions of a context of ``seq_len`` keys,
so query ``i`` sits at position ``p = seq_len - query_len + i`` and sees the
keys at ``(p - window, p]``. Two entry points share one kernel:

- ``flash_varlen_attention``: keys are the step's own packed ``k, v`` (no
  cached prefix: ``seq_len == query_len``), read without any indirection;
- ``flash_prefill_with_kvcache``: keys are read from the cache through the
  block tables (contiguous or paged layout), so chunked prefill and
  prefix-cache hits are the same case as a fresh prompt.

Why it is fast: one program per (block of ``BLOCK_M`` queries, sequence,
query head) walks only the key tiles some row of its block can see: tiles
before the window of its first query or after its last query are never
loaded (that is the sliding-window speed-up: O(L x W) work, not O(L^2)).
Of the tiles it visits, those that every row sees whole skip the mask
arithmetic; only the tiles on the causal diagonal and on the window's edge
are masked. A KV head's rows are shared by its query heads through the
cache (GQA without repeating K/V). The tiles are walked by ``attn_ops.attend_tiles``,
as in every kernel of both backends. The PyTorch references are in ``prefill_ref``.
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
    check_power_of_two,
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


@triton.jit
def _flash_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    sinks_ptr, first_seq, qk_scale, softcap, window, num_queries_per_kv,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btn,
    stride_sb, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    tl.static_assert(D_PAD >= HEAD_DIM)
    pid_m = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    query_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    m_start = pid_m * BLOCK_M
    if m_start >= query_len:  # the grid covers the longest sequence of the batch
        return
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq_len = query_len
    context_len = seq_len - query_len
    kv_head = head // num_queries_per_kv

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    io_mask = (offs_m < query_len)[:, None] & d_mask[None, :]
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=io_mask, other=0.0)  # [BLOCK_M, D_PAD]
    q_pos = context_len + offs_m

    # rows of this block sit at [first_pos, last_pos] and see keys (first_pos - window, last_pos]
    first_pos = context_len + m_start
    last_pos = tl.minimum(first_pos + BLOCK_M, seq_len) - 1
    kv_lo = tl.maximum(first_pos - window + 1, 0)
    t_lo = kv_lo // BLOCK_N
    t_hi = tl.cdiv(last_pos + 1, BLOCK_N)
    # tiles every row sees whole: inside the last row's window and not past the first row
    full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N)
    full_hi = (first_pos + 1) // BLOCK_N
    mid_lo = tl.minimum(tl.maximum(full_lo, t_lo), t_hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), t_hi)

    acc, l_i, m_i = softmax_state(BLOCK_M, D_PAD)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    # masked tiles before the fully visible ones (window edge), those, then the diagonal
    acc, l_i, m_i = attend_tiles(
        acc, l_i, m_i, q, q_pos, t_lo, mid_lo, kv_lo, seq_len, window, qk_scale, softcap,
        k_ptr, v_ptr, table_ptr, stride_btn, q_start, kv_head, offs_d, d_mask,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,
        BLOCK_N, BLOCK_SIZE, PAGED, True, PRECISION, QUANT, SOFTCAP)
    acc, l_i, m_i = attend_tiles(
        acc, l_i, m_i, q, q_pos, mid_lo, mid_hi, kv_lo, seq_len, window, qk_scale, softcap,
        k_ptr, v_ptr, table_ptr, stride_btn, q_start, kv_head, offs_d, d_mask,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,
        BLOCK_N, BLOCK_SIZE, PAGED, False, PRECISION, QUANT, SOFTCAP)
    acc, l_i, m_i = attend_tiles(
        acc, l_i, m_i, q, q_pos, mid_hi, t_hi, kv_lo, seq_len, window, qk_scale, softcap,
        k_ptr, v_ptr, table_ptr, stride_btn, q_start, kv_head, offs_d, d_mask,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,
        BLOCK_N, BLOCK_SIZE, PAGED, True, PRECISION, QUANT, SOFTCAP)

    l_i = fold_sinks(l_i, m_i, sinks_ptr, tl.zeros([BLOCK_M], tl.int32) + head, offs_m < query_len,
                               SINKS)
    # every real row sees at least its own key, so l > 0; padding rows are not stored
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


# -- Python wrappers ------------------------------------------------------------------------------------


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per architecture (``attn_ops.arch_entry``), by input
# width ("16": fp16 / bf16, "32": fp32) and padded head dim (the first row with d_pad <= its
# bound). Chosen by compiling each entry for its target (Triton 3.9, registers / spills / shared
# memory, over plain, int8 and fp8 caches):
# - sm_80 (A100): every BLOCK_M=128 tile hits 255 registers and spills (36-76 B per thread in
#   16 bit, 1.2-1.7 KB with int8 KV); BLOCK_M=64 does not: 4 warps at d64, 8 at d128 and d256
#   (4 still spill there). Shared memory stays under 99 KiB, so sm_86 / sm_89 launch it too.
# - sm_90 (H100): BLOCK_M=128 fits up to d128 (4 warps at d64, 8 at d128: <= 252 registers,
#   no spills); d256 as on sm_80.
# - fp32 (exact ``ieee`` dots, no tensor cores): 8 warps; BLOCK_M=64 with 4 warps spilled
#   46 KB per thread at d128 on sm_80; one stage at d256 keeps shared memory at 96 KiB.
# - None: the interpreter (tests) and the fallback where no GPU is known.
_FP32 = ((128, (64, 32, 8, 2)), (256, (32, 32, 8, 1)))
# sm_90 lays the same fp32 tiles out differently: (64, 32, 8, 2) spills 2.4 KB per thread at
# d80-d128 and (32, 32, 8, 1) 4.3 KB at d256; 16-key tiles (80 registers at d128) do not spill
_FP32_SM90 = ((64, (64, 32, 8, 2)), (128, (32, 16, 8, 2)), (256, (16, 16, 4, 1)))
PREFILL_TABLE: dict[tuple[int, int] | None, dict[str, tuple]] = {
    None: {"16": ((64, (128, 64, 4, 3)), (128, (128, 64, 8, 3)), (256, (64, 32, 8, 2))),
           "32": ((128, (64, 32, 4, 2)), (256, (32, 32, 4, 2)))},
    (8, 0): {"16": ((64, (64, 64, 4, 3)), (128, (64, 64, 8, 3)), (256, (64, 32, 8, 2))), "32": _FP32},
    (9, 0): {"16": ((64, (128, 64, 4, 3)), (128, (128, 64, 8, 3)), (256, (64, 32, 8, 2))), "32": _FP32_SM90},
}


def prefill_config(d_pad: int, dtype: torch.dtype, cap: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a GPU of capability ``cap``: ``PREFILL_TABLE``."""
    rows = arch_entry(PREFILL_TABLE, cap)["32" if dtype == torch.float32 else "16"]
    return next(config for bound, config in rows if d_pad <= bound)


def _launch(q, k, v, out, cu_seqlens, seq_lens, block_tables, scale, sliding_window, max_query_len,
            first_seq, block_m, block_n, paged, what, k_scale=None, v_scale=None, softcap=None, sinks=None):
    num_seqs = cu_seqlens.shape[0] - 1
    if not 0 <= first_seq <= num_seqs:
        raise ValueError(f"{what}: first_seq must be in [0, {num_seqs}], got {first_seq}")
    if num_seqs == first_seq or q.shape[0] == 0:
        return out
    group = q.shape[1] // k.shape[-2]
    head_dim = q.shape[2]
    d_pad = head_dim_pad(head_dim)
    bm, bn, num_warps, num_stages = prefill_config(d_pad, q.dtype, capability(q.device))
    bm, bn = block_m or bm, block_n or bn
    check_power_of_two(bm, "block_m", what)
    check_power_of_two(bn, "block_n", what)
    if max_query_len is None:
        max_query_len = int((cu_seqlens[first_seq + 1:] - cu_seqlens[first_seq:-1]).max())
    if max_query_len <= 0:
        return out
    if paged:
        kb, kt, kh, kd = k.stride()
        vb, vt, vh, vd = v.stride()
        bt_strides, block_size = block_tables.stride(), k.shape[1]
    else:
        (kt, kh, kd), (vt, vh, vd), kb, vb = k.stride(), v.stride(), 0, 0
        bt_strides, block_size = (0, 0), 1
    grid = (triton.cdiv(max_query_len, bm), num_seqs - first_seq, q.shape[1])
    k, v, scale_ptrs, scale_strides, quant = quant_args(k, v, k_scale, v_scale)
    cap, sinks, capped, sunk = feature_args(softcap, sinks, q.shape[1], q.device, what)
    _flash_prefill_kernel[grid](
        q, k, v, out, cu_seqlens, seq_lens, block_tables, *scale_ptrs, sinks if sunk else q,
        first_seq, scale * LOG2E, cap, window_arg(sliding_window, what), group,
        *q.stride(), kb, kt, kh, kd, vb, vt, vh, vd, *out.stride(), *bt_strides, *scale_strides,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, BLOCK_SIZE=block_size, PAGED=paged,
        PRECISION=dot_precision(q.dtype), QUANT=quant, SOFTCAP=capped, SINKS=sunk, num_warps=num_warps,
        num_stages=num_stages)
    return out


def _check_cu(cu: torch.Tensor, name: str, what: str) -> None:
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{what}: {name} must be int32 [B+1] (prefix sums of query lengths), got "
                         f"{cu.dtype} {tuple(cu.shape)}")


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           scale: float, *, sliding_window: int | None = None,
                           max_seqlen: int | None = None, first_seq: int = 0,
                           out: torch.Tensor | None = None, block_m: int | None = None,
                           block_n: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal self-attention of packed sequences: q [T, H, D], k, v [T, Hkv, D] -> [T, H, D].

    Sequence ``b`` is rows ``cu_seqlens[b] : cu_seqlens[b+1]`` (int32 [B+1]) of
    q, k and v. Sequences before ``first_seq`` are left alone (their rows of
    ``out`` are not written). ``max_seqlen`` (a host int) spares a device sync;
    ``block_m`` / ``block_n`` override the tile sizes (powers of two >= 16). ``softcap``: scores
    soft-capped, ``softcap * tanh(s / softcap)``; ``sinks`` [H]: one logit per query head joined to
    the softmax denominator (attention sinks).
    """
    what = "flash_varlen_attention"
    check_query(q, what)
    check_kv(q, k, v, what, "k and v")
    _check_cu(cu_seqlens, "cu_seqlens", what)
    if k.dim() != 3 or k.shape[0] != q.shape[0]:
        raise ValueError(f"{what}: k and v must be [T={q.shape[0]}, num_kv_heads, head_dim], got {tuple(k.shape)}")
    out = output_for(q, out, what)
    return _launch(q, k, v, out, cu_seqlens, cu_seqlens, cu_seqlens, scale, sliding_window, max_seqlen,
                   first_seq, block_m, block_n, False, what, softcap=softcap, sinks=sinks)


def flash_prefill_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                               max_query_len: int | None = None, first_seq: int = 0,
                               out: torch.Tensor | None = None, block_m: int | None = None,
                               block_n: int | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, softcap: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Queries over their whole cached context: q [T, H, D] -> [T, H, D].

    k_cache, v_cache: [num_blocks, block_size, Hkv, D], already holding every
    key up to ``seq_lens[b]`` (int32 [B]) at the blocks ``block_tables[b]``
    (int32 [B, max_blocks]) lists. Query rows ``cu_query_lens[b] :
    cu_query_lens[b+1]`` are the last positions of sequence ``b``. Only
    sequences ``first_seq..B-1`` are computed (earlier rows of ``out`` are
    left alone: the decode kernel owns them). ``k_scale`` / ``v_scale`` ([num_blocks,
    block_size, Hkv] float32) mark int8 / float8_e4m3fn caches. ``softcap`` and ``sinks``: as
    ``flash_varlen_attention``'s.
    """
    what = "flash_prefill_with_kvcache"
    check_query(q, what)
    quant = check_scales(k_cache, v_cache, k_scale, v_scale, what)
    check_kv(q, k_cache, v_cache, what, "k_cache and v_cache", quant)
    check_block_tables(block_tables, seq_lens, what)
    _check_cu(cu_query_lens, "cu_query_lens", what)
    if k_cache.dim() != 4:
        raise ValueError(f"{what}: the caches must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)}")
    if cu_query_lens.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"{what}: cu_query_lens must have B+1 = {seq_lens.shape[0] + 1} entries, "
                         f"got {cu_query_lens.shape[0]}")
    out = output_for(q, out, what)
    return _launch(q, k_cache, v_cache, out, cu_query_lens, seq_lens, block_tables, scale, sliding_window,
                   max_query_len, first_seq, block_m, block_n, True, what, k_scale, v_scale, softcap, sinks)
