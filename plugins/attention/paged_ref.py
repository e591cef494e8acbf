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
``paged_prefill_attention`` also takes ``tree_masks`` (tree speculative decoding, see
``StepContext.tree_masks``): a sequence listed there attends with its ancestor mask.

Quantized KV (``k_scale`` / ``v_scale`` given: int8 / float8_e4m3fn caches with a
float32 scale per (slot, KV head)): the write quantizes (``store_kv``), the reads
dequantize the gathered rows to q's dtype (``dequantize_kv``) before attending.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lmplug_attention.sdpa import causal_mask

from lmplug.interfaces.kvcache import dequantize_kv, store_kv


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] -> cache rows ``slot_mapping`` [T] of k_cache, v_cache [N, block_size, Hkv, D]
    (quantized, with scales into k_scale, v_scale [N, block_size, Hkv], when those are given)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    store_kv(k_cache, k_scale, k, slot_mapping)
    store_kv(v_cache, v_scale, v, slot_mapping)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                   scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first ``num_tokens`` slots of each table's blocks: [B, blocks] -> [B, num_tokens, Hkv, D]
    (dequantized to ``dtype`` with ``scale`` [N, block_size, Hkv] when the cache is quantized)."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    tables = block_tables[:, :num_blocks].long()

    def gather(t: torch.Tensor) -> torch.Tensor:
        # one gather of whole blocks for the whole batch; embedding's row gather is several
        # times faster on CPU than index_select over a 4-d tensor
        rows = F.embedding(tables.reshape(-1), t.reshape(t.shape[0], -1))
        return rows.view(tables.shape[0], num_blocks * block_size, *t.shape[2:])  # [B, nb * bs, ...]

    blocks = gather(cache)
    if scale is not None:  # whole blocks, then the slice: the layout an unquantized cache gives
        blocks = dequantize_kv(blocks, gather(scale), dtype or torch.float32)
    return blocks[:, :num_tokens]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None, max_seq_len: int | None = None,
                           partition_size: int | None = None, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], block_tables [B, max_blocks] int32, seq_lens [B] -> [B, H, D] (into ``out`` if given).

    ``partition_size`` is accepted for parity with the kernel (its split-K path
    gives the same result) and ignored.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    k = gather_context(k_cache, block_tables, max_seq_len, k_scale, q.dtype)  # [B, S, Hkv, D]
    v = gather_context(v_cache, block_tables, max_seq_len, v_scale, q.dtype)
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
                            max_query_len: int | None = None, out: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            tree_masks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, H, D] (sequences back to back), cu_query_lens [B+1], seq_lens [B] -> [T, H, D] (into ``out``).

    ``tree_masks``: sequence index (in this call) -> bool [query_len, query_len] ancestor mask."""
    out = torch.empty_like(q) if out is None else out
    tree_masks = tree_masks or {}
    starts = cu_query_lens.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        k = gather_context(k_cache, block_tables[i:i + 1], seq_len, k_scale, q.dtype)[0]  # [S, Hkv, D]
        v = gather_context(v_cache, block_tables[i:i + 1], seq_len, v_scale, q.dtype)[0]
        out[start:end] = _attend(q[start:end], k, v, seq_len, scale, sliding_window, tree_masks.get(i))
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float,
            window: int | None, tree: torch.Tensor | None = None) -> torch.Tensor:
    # q: [L, H, D] -> [H, L, D]; k, v: [S, Hkv, D] -> [Hkv, S, D]
    # (4-d, with a batch of one: on CPU, 3-d inputs miss SDPA's flash kernel and take the math path)
    query_len = q.shape[0]
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    if query_len == seq_len and window is None and tree is None:  # nothing cached: the plain causal case
        out = F.scaled_dot_product_attention(*args, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = causal_mask(query_len, seq_len, window, q.device, tree)
        out = F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
