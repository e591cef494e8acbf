"""Prefill attention in PyTorch: the reference of every prefill kernel (``flash`` and ``paged``).

Same arguments as the kernels' entry points, computed in fp32 (as the kernels
accumulate) and returned in q's dtype. The semantics they pin down:

- query ``i`` of a sequence with ``query_len`` new tokens and ``seq_len``
  keys sits at position ``seq_len - query_len + i`` and sees key positions
  ``(p - sliding_window, p]`` (causal; no lower bound without a window);
- query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA,
  computed by grouping the query heads, never by repeating K/V);
- cached keys are read through the block tables (``kv_ref.gather_context``;
  the contiguous layout is one block per sequence), quantized caches
  dequantized to q's dtype as gathered (the kernels' op order).

Keys no query can see (past ``seq_len``, or behind every window) are zeroed
before they meet a score, so whatever those slots hold (freed blocks, NaN)
never reaches a result — the kernels never load them.

- ``varlen_attention``: keys are the step's own packed K/V
  (``flash_prefill_kernels.flash_varlen_attention``);
- ``prefill_attention``: keys from the cache (``flash_prefill_with_kvcache``,
  ``paged_prefill_kernels.paged_prefill_attention``).
"""

from __future__ import annotations

import itertools

import torch
from lmplug_attention.kv_ref import gather_context


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[..., L, S] bool: key position ``k_pos`` is visible to the query at ``q_pos``."""
    visible = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if sliding_window is not None:
        visible &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - sliding_window
    return visible


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of float32 ``scores``; with ``sinks`` (broadcast to
    ``scores[..., :1]``: one logit per query head), each ``exp(sink)`` joins its row's
    denominator and carries no value (attention sinks, GPT-OSS)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    logits = torch.cat([scores, sinks.to(scores.dtype).expand(scores[..., :1].shape)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [L, H, D], k, v [S, Hkv, D], visible [L, S] -> [L, H, D] fp32 (grouped heads)."""
    num_kv_heads = k.shape[1]
    seen = visible.any(dim=0)[:, None, None]  # keys no query sees may hold anything, even NaN
    k, v = torch.where(seen, k.float(), 0.0), torch.where(seen, v.float(), 0.0)
    qg = q.float().unflatten(1, (num_kv_heads, -1))  # [L, Hkv, G, D]
    scores = torch.einsum("lhgd,shd->hgls", qg, k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hgls,shd->lhgd", torch.softmax(scores, dim=-1), v)
    return out.flatten(1, 2)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, *, sliding_window: int | None = None) -> torch.Tensor:
    """Causal self-attention of packed sequences: q [T, H, D], k, v [T, Hkv, D] -> [T, H, D]."""
    out = torch.empty_like(q)
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        pos = torch.arange(end - start, device=q.device)
        visible = visible_keys(pos, pos, sliding_window)
        out[start:end] = _attend(q[start:end], k[start:end], v[start:end], visible, scale).to(q.dtype)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_query_lens: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, *, sliding_window: int | None = None,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Queries over their whole cached context: q [T, H, D] -> [T, H, D]. Query rows
    ``cu_query_lens[b] : cu_query_lens[b+1]`` are the last positions of sequence ``b``, whose
    ``seq_lens[b]`` keys sit in the blocks ``block_tables[b]`` lists."""
    out = torch.empty_like(q)
    bounds = cu_query_lens.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if start == end:
            continue
        table = block_tables[b:b + 1]
        k = gather_context(k_cache, table, seq_len, k_scale, q.dtype)[0]
        v = gather_context(v_cache, table, seq_len, v_scale, q.dtype)[0]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = visible_keys(q_pos, torch.arange(seq_len, device=q.device), sliding_window)
        out[start:end] = _attend(q[start:end], k, v, visible, scale).to(q.dtype)
    return out
