"""PagedAttention in PyTorch: the reference the Triton kernels are tested against, and the CPU path.

Same functions, arguments and semantics as ``paged_kernels.py``:

- ``reshape_and_cache``: write the step's K/V into the cache slots of ``slot_mapping``
  (slot ``s`` = block ``s // block_size``, offset ``s % block_size``; a negative slot is skipped).
- ``paged_decode_attention``: one query token per sequence attending over its whole
  cached context, read through its block table. Batched: the blocks of every
  sequence are gathered at once to ``[B, max_ctx, Hkv, D]`` and the query heads of
  each KV head attend together (GQA without repeating K/V); positions past a
  sequence's length are masked.
- ``paged_prefill_attention``: varlen queries (``cu_query_lens``) that are the
  last ``query_len`` positions of a context of ``seq_len`` keys (a cached prefix
  plus the new tokens, all read through the block table), causal, one sequence
  at a time.

An optional sliding window lets a query at position ``p`` see keys ``(p - window, p]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lmplug_attention.sdpa import causal_mask


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] -> cache rows ``slot_mapping`` [T] of k_cache, v_cache [N, block_size, Hkv, D]."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` slots of each table's blocks: [B, blocks] -> [B, num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    tables = block_tables[:, :num_blocks].long()
    # one gather of whole blocks for the whole batch; embedding's row gather is several
    # times faster on CPU than index_select over a 4-d tensor
    rows = F.embedding(tables.reshape(-1), cache.reshape(cache.shape[0], -1))
    blocks = rows.view(-1, *cache.shape[1:])  # [B * num_blocks, bs, Hkv, D]
    return blocks.view(tables.shape[0], num_blocks * block_size, *cache.shape[2:])[:, :num_tokens]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None, max_seq_len: int | None = None,
                           partition_size: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], block_tables [B, max_blocks] int32, seq_lens [B] -> [B, H, D] (into ``out`` if given).

    ``partition_size`` is accepted for parity with the kernel (its split-K path
    gives the same result) and ignored.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    k = gather_context(k_cache, block_tables, max_seq_len)  # [B, S, Hkv, D]
    v = gather_context(v_cache, block_tables, max_seq_len)
    pos = torch.arange(max_seq_len, device=q.device)
    lens = seq_lens.to(q.device).long().unsqueeze(1)
    mask = pos.unsqueeze(0) < lens  # [B, S]
    if not bool(mask.all()):
        # slots past a sequence's end (its last block's tail, table padding) hold whatever the
        # block held before; SDPA still multiplies them by a zero weight, and 0 x NaN = NaN
        past_end = (~mask).nonzero(as_tuple=True)
        k[past_end] = 0
        v[past_end] = 0
    if sliding_window is not None:
        mask &= pos.unsqueeze(0) >= lens - sliding_window
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    result = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale)
    result = result.reshape(batch, num_heads, head_dim)
    if out is None:
        return result
    return out.copy_(result)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                            max_query_len: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (sequences back to back), cu_query_lens [B+1], seq_lens [B] -> [T, H, D] (into ``out``)."""
    out = torch.empty_like(q) if out is None else out
    starts = cu_query_lens.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        k = gather_context(k_cache, block_tables[i:i + 1], seq_len)[0]  # [S, Hkv, D]
        v = gather_context(v_cache, block_tables[i:i + 1], seq_len)[0]
        out[start:end] = _attend(q[start:end], k, v, seq_len, scale, sliding_window)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float,
            window: int | None) -> torch.Tensor:
    # q: [L, H, D] -> [H, L, D]; k, v: [S, Hkv, D] -> [Hkv, S, D]
    query_len = q.shape[0]
    args = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    if query_len == seq_len and window is None:  # nothing cached: the plain causal case
        out = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = causal_mask(query_len, seq_len, window, q.device)
        out = F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
