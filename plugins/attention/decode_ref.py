"""Decode attention in PyTorch: the reference of the decode kernel (``decode_ops``) of both backends.

One query token per sequence at position ``seq_len - 1`` attends over its
cached keys ``(seq_len - 1 - sliding_window, seq_len - 1]``, read through its
block table (``kv_ref.gather_context``), quantized caches dequantized to q's
dtype as gathered; the query heads of a KV head attend together (GQA without
repeating K/V). Batched: every sequence's context padded to the longest, the
padding and the keys outside each window zeroed before they meet a score
(they may hold anything, NaN included), computed in fp32 and returned in q's
dtype. The ``paged`` backend also runs it as its PyTorch decode of quantized
KV (the CPU decode paths ``paged_cpu`` and ``paged_native`` read plain KV only).
"""

from __future__ import annotations

import torch
from lmplug_attention.kv_ref import gather_context
from lmplug_attention.prefill_ref import sink_softmax, visible_keys


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                     sliding_window: int | None = None, max_seq_len: int | None = None,
                     out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], block_tables [B, max_blocks] int32, seq_lens [B] -> [B, H, D] (into ``out``
    when given). ``max_seq_len`` (a host int, at least the longest) spares a device sync.
    ``softcap``: scores soft-capped; ``sinks`` [H]: attention sinks (``prefill_ref.sink_softmax``)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if batch else 0
    pos = torch.arange(max_seq_len, device=q.device)  # [S]
    lens = seq_lens.to(q.device).long()
    visible = visible_keys(lens - 1, pos, sliding_window) & (pos < lens[:, None])  # [B, S]

    def gather(cache: torch.Tensor, cache_scale: torch.Tensor | None) -> torch.Tensor:
        rows = gather_context(cache, block_tables, max_seq_len, cache_scale, q.dtype)  # [B, S, Hkv, D]
        return torch.where(visible[:, :, None, None], rows.float(), 0.0)

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    qg = q.float().reshape(batch, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k) * scale
    if softcap is not None:  # soft-capped scores (Gemma 2)
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    sink = None if sinks is None else sinks.to(q.device).view(1, num_kv_heads, -1, 1)
    result = torch.einsum("bhgs,bshd->bhgd", sink_softmax(scores, sink), v)
    result = result.reshape(batch, num_heads, head_dim).to(q.dtype)
    return result if out is None else out.copy_(result)
