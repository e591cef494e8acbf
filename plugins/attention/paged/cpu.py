"""Batched paged decode tuned for CPUs: the ``paged`` backend's decode path on CPU.

The decode (``decode_ref.decode_attention``, the reference it is tested against) of
plain KV, laid out for CPU matrix units:

- the context of every sequence is gathered once per layer straight into
  ``[B, Hkv, S, D]`` (one row per slot and KV head, so no transpose copy
  follows), through an index that depends only on the step's block tables and
  lengths and is therefore built once per step (``decode_index``) and reused by
  every layer;
- the query heads of a KV head attend together (GQA without repeating K/V) as two
  batched matmuls over contiguous operands, with the softmax in float32;
- positions past a sequence's end (or outside its sliding window) read that
  sequence's first slot, which always holds real data, and get a zero weight.

On CPU, SDPA with a mask over a strided ``[B, S, Hkv, D]`` gather spends most of
its time in the strided ``Q·Kᵀ``. Compare the two with
``benchmarks/bench_paged_decode.py --impl cpu`` and ``--impl torch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lmplug_attention.prefill_ref import sink_softmax

from lmplug.kit.kv_layout import kv_slots


@dataclass
class DecodeIndex:
    rows: torch.Tensor  # [B, Hkv, S] int64: row of a [slots * Hkv, D] view of the cache
    valid: torch.Tensor  # [B, S] bool: positions each sequence attends to


def decode_index(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_kv_heads: int,
                 max_seq_len: int, sliding_window: int | None = None) -> DecodeIndex:
    """The gather rows and the mask of one decode batch (see the module docstring)."""
    device = block_tables.device
    pos = torch.arange(max_seq_len, device=device)
    lens = seq_lens.to(device).long().unsqueeze(1)
    valid = pos.unsqueeze(0) < lens  # [B, S]
    if sliding_window is not None:
        valid &= pos.unsqueeze(0) >= lens - sliding_window
    safe = torch.where(valid, pos, 0)  # masked positions read the first slot (real data, weight 0)
    slots = kv_slots(block_tables, safe, block_size)  # [B, S]
    heads = torch.arange(num_kv_heads, device=device).view(1, -1, 1)
    return DecodeIndex(slots.unsqueeze(1) * num_kv_heads + heads, valid)


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               index: DecodeIndex, scale: float, out: torch.Tensor | None = None,
                               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], caches [N, block_size, Hkv, D], ``index`` from ``decode_index`` -> [B, H, D];
    scores soft-capped, ``softcap * tanh(s / softcap)``, where ``softcap`` is given; ``sinks`` [H]:
    one logit per query head in each row's softmax denominator (``prefill_ref.sink_softmax``)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = F.embedding(index.rows, k_cache.view(-1, head_dim))  # [B, Hkv, S, D], contiguous
    v = F.embedding(index.rows, v_cache.view(-1, head_dim))
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [B, Hkv, G, S]
    scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores.masked_fill_(~index.valid[:, None, None, :], float("-inf"))
    sink = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1)
    probs = sink_softmax(scores, sink).to(v.dtype)
    result = torch.matmul(probs, v).reshape(batch, num_heads, head_dim)
    if out is None:
        return result
    return out.copy_(result)
