"""PyTorch twins of the ``flash`` kernels: same arguments, same semantics, same output dtype.

Each function computes in fp32 (as the kernels accumulate) and returns q's
dtype. The semantics they pin down:

- query ``i`` of a sequence with ``query_len`` new tokens and ``seq_len``
  keys sits at position ``seq_len - query_len + i`` and sees key positions
  ``(p - sliding_window, p]`` (causal; no lower bound without a window);
- query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA,
  computed by grouping the query heads, never by repeating K/V);
- cached keys of sequence ``b`` live at slot ``block_tables[b, p //
  block_size] * block_size + p % block_size`` of the cache flattened to
  ``[slots, Hkv, D]`` (the contiguous layout is one block per sequence).

Prefill loops over sequences (each is one batched matmul); decode is fully
batched. Keys no query can see (past ``seq_len``, or behind every window)
are zeroed before they meet a score, so whatever those slots hold (freed
blocks, NaN) never reaches a result — the kernels never load them.

Quantized caches (``k_scale`` / ``v_scale`` given) are dequantized to q's dtype
as gathered (``dequantize_kv``: the kernels' op order), then read as above.
"""

from __future__ import annotations

import itertools

import torch

from lmplug.interfaces.kvcache import dequantize_kv


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[..., L, S] bool: key position ``k_pos`` is visible to the query at ``q_pos``."""
    visible = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if sliding_window is not None:
        visible &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - sliding_window
    return visible


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [L, H, D], k, v [S, Hkv, D], visible [L, S] -> [L, H, D] fp32 (grouped heads)."""
    num_kv_heads = k.shape[1]
    seen = visible.any(dim=0)[:, None, None]  # keys no query sees may hold anything, even NaN
    k, v = torch.where(seen, k.float(), 0.0), torch.where(seen, v.float(), 0.0)
    qg = q.float().unflatten(1, (num_kv_heads, -1))  # [L, Hkv, G, D]
    scores = torch.einsum("lhgd,shd->hgls", qg, k.float()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hgls,shd->lhgd", torch.softmax(scores, dim=-1), v.float())
    return out.flatten(1, 2)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                   scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's first ``seq_len`` cached rows, [seq_len, Hkv, D] (dequantized to ``dtype``
    when ``scale`` [num_blocks, block_size, Hkv] is given)."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    rows = cache.flatten(0, 1)[slots]
    if scale is None:
        return rows
    return dequantize_kv(rows, scale.flatten(0, 1)[slots], dtype or torch.float32)


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         scale: float, *, sliding_window: int | None = None) -> torch.Tensor:
    """Twin of ``flash_varlen_attention``: q [T, H, D], k, v [T, Hkv, D] packed -> [T, H, D]."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        pos = torch.arange(end - start, device=q.device)
        visible = visible_keys(pos, pos, sliding_window)
        out[start:end] = _attend(q[start:end], k[start:end], v[start:end], visible, scale).to(q.dtype)
    return out


def prefill_with_kvcache_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float, *,
                             sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of ``flash_prefill_with_kvcache``: q [T, H, D] over the caches -> [T, H, D]."""
    out = torch.empty_like(q)
    bounds = cu_query_lens.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if start == end:
            continue
        k = gather_context(k_cache, block_tables[b], seq_len, k_scale, q.dtype)
        v = gather_context(v_cache, block_tables[b], seq_len, v_scale, q.dtype)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = visible_keys(q_pos, torch.arange(seq_len, device=q.device), sliding_window)
        out[start:end] = _attend(q[start:end], k, v, visible, scale).to(q.dtype)
    return out


def decode_with_kvcache_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                            sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of ``flash_decode_with_kvcache``: q [B, H, D], one token per sequence at position
    ``seq_len - 1`` -> [B, H, D]. Batched: every sequence's context padded to the longest."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max()) if batch else 0
    pos = torch.arange(max_len, device=q.device)  # [S]
    seq_lens = seq_lens.long()
    in_context = pos < seq_lens[:, None]  # [B, S]
    block_idx = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.long()[:, block_idx] * block_size + pos % block_size  # [B, S]
    slots = torch.where(in_context, slots, 0)

    visible = visible_keys(seq_lens - 1, pos, sliding_window) & in_context  # [B, S]

    def gather(cache: torch.Tensor, cache_scale: torch.Tensor | None) -> torch.Tensor:
        # [B, S, Hkv, D], zero where not visible
        rows = cache.flatten(0, 1)[slots]
        if cache_scale is not None:
            rows = dequantize_kv(rows, cache_scale.flatten(0, 1)[slots], q.dtype)
        return torch.where(visible[:, :, None, None], rows.float(), 0.0)

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    qg = q.float().view(batch, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgs,bshd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
