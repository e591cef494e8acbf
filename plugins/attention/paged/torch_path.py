"""The ``paged`` backend's PyTorch prefill: the CPU default (and ``kernels: torch``).

Same arguments and result as ``paged_prefill_kernels.paged_prefill_attention``
(tested against the same reference, ``prefill_ref.prefill_attention``), plus
``query_masks`` (tree speculative decoding, see ``StepContext.query_masks``): a
sequence listed there attends with its ancestor mask. One sequence at a time,
exactly as the ``sdpa`` backend attends (``sdpa.context_kv``, ``sdpa.attend``),
so the two backends give one result for one prefill; a layer with attention sinks attends
here with its scores written out (``attend_with_sinks``), which ``sdpa.attend`` does not do. The rest of the PyTorch op
set: the write is ``kv_ref.reshape_and_cache``; the decode is ``paged_cpu`` /
``paged_native`` for plain KV and ``decode_ref.decode_attention`` for quantized KV.
"""

from __future__ import annotations

import torch
from lmplug_attention.prefill_ref import sink_softmax
from lmplug_attention.sdpa import attend, causal_mask, context_kv


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                            max_query_len: int | None = None, out: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            query_masks: dict[int, torch.Tensor] | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (sequences back to back), cu_query_lens [B+1], seq_lens [B] -> [T, H, D] (into ``out``).

    ``query_masks``: sequence index (in this call) -> bool [query_len, query_len] ancestor mask;
    ``softcap``: scores soft-capped (``sdpa.explicit_attention``); ``sinks`` [H]: attention sinks."""
    out = torch.empty_like(q) if out is None else out
    query_masks = query_masks or {}
    starts = cu_query_lens.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        k, v = context_kv(k_cache, v_cache, block_tables[i], seq_len, k_scale, v_scale, q.dtype)
        tree = query_masks.get(i)
        plain = end - start == seq_len and sliding_window is None and tree is None and sinks is None
        mask = None if plain else causal_mask(end - start, seq_len, sliding_window, q.device, tree)
        if sinks is None:
            out[start:end] = attend(q[start:end], k, v, seq_len, scale, mask, softcap)
        else:
            out[start:end] = attend_with_sinks(q[start:end], k, v, mask, scale, softcap, sinks)
    return out


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """q [L, H, D] over k, v [S, Hkv, D] with ``mask`` (bool [L, S], True = attend), the query heads
    of a KV head grouped, scores (soft-capped where ``softcap``) in float32, ``sinks`` [H] in each
    row's softmax denominator -> [L, H, D]."""
    length, heads, dim = q.shape
    hkv = k.shape[1]
    qg = q.permute(1, 0, 2).reshape(hkv, heads // hkv, length, dim)
    scores = torch.matmul(qg, k.permute(1, 2, 0).unsqueeze(1)).float() * scale  # [Hkv, G, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = sink_softmax(scores, sinks.view(hkv, -1, 1, 1)).to(v.dtype)
    out = torch.matmul(probs, v.transpose(0, 1).unsqueeze(1))  # [Hkv, G, L, D]
    return out.reshape(heads, length, dim).transpose(0, 1)
