"""The ``paged`` backend's PyTorch prefill: the CPU default (and ``kernels: torch``).

Same arguments and result as ``paged_prefill_kernels.paged_prefill_attention``
(tested against the same reference, ``prefill_ref.prefill_attention``), plus
``query_masks`` (tree speculative decoding, see ``StepContext.query_masks``): a
sequence listed there attends with its ancestor mask. One sequence at a time,
exactly as the ``sdpa`` backend attends (``sdpa.context_kv``, ``sdpa.attend``),
so the two backends give one result for one prefill (soft-capped and sink layers too: ``sdpa.attend``
writes their scores out). The rest of the PyTorch op
set: the write is ``kv_ref.reshape_and_cache``; the decode is ``paged_cpu`` /
``paged_native`` for plain KV and ``decode_ref.decode_attention`` for quantized KV.
"""

from __future__ import annotations

import torch
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
        plain = end - start == seq_len and sliding_window is None and tree is None
        mask = None if plain else causal_mask(end - start, seq_len, sliding_window, q.device, tree)
        out[start:end] = attend(q[start:end], k, v, seq_len, scale, mask, softcap, sinks)
    return out

