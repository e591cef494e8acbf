"""lmplug's attention inside a transformers model.

transformers calls ``lmplug_attention(module, q, k, v, mask, scaling=..., sliding_window=...,
softcap=..., s_aux=...)`` for every attention layer (registered with ``AttentionInterface``; the
mask function registered with ``AttentionMaskInterface`` builds no mask). The step's
``StepContext``, KV views and attention backend reach it through ``STEP`` (a ``ContextVar`` the
module sets around its forward). A layer the backend computes exactly (its scale and window,
no soft-cap, no sinks) goes to ``AttentionBackend.forward``; any other layer is computed here by a
torch reference over the same cache (written at ``ctx.slot_mapping``, read through the block
tables), so per-layer features the backends lack stay correct.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import torch

from lmplug.api import AttentionBackend, KVLayerView, StepContext
from lmplug.kit.kv_layout import kv_slots
from lmplug.kit.kv_quant import dequantize_kv, store_kv

NAME = "lmplug"


@dataclass
class Step:
    ctx: StepContext
    views: list[KVLayerView]
    backend: AttentionBackend


STEP: contextvars.ContextVar[Step] = contextvars.ContextVar("lmplug_transformers_step")


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function: lmplug's backends mask by the step's sequences themselves."""
    return


def lmplug_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    step = STEP.get()
    layer = module.layer_idx
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H(kv), D]
    backend = step.backend
    scale = backend.scale if scaling is None else float(scaling)
    plain = (softcap is None and s_aux is None and abs(scale - backend.scale) <= 1e-9 * backend.scale
             and sliding_window == backend.sliding_window)
    kv = step.views[layer]
    if plain:
        out = backend.forward(layer, q.contiguous(), k.contiguous(), v.contiguous(), kv, step.ctx)
    else:
        out = reference_attention(q, k, v, kv, step.ctx, scale, sliding_window, softcap, s_aux)
    return out[None], None


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayerView, ctx: StepContext,
                        scale: float, window: int | None, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """Write the step's K/V into the cache, then attend each sequence over its cached context
    with soft-capped scores, a window and sink logits where given. q [T, H, D] -> [T, H, D]."""
    if ctx.query_masks:
        raise RuntimeError("transformers fallback: tree attention is not supported on layers with "
                           "soft-capping, sinks, a per-layer window or a custom scale")
    store_kv(kv.k_cache, kv.k_scale, k, ctx.slot_mapping)
    store_kv(kv.v_cache, kv.v_scale, v, ctx.slot_mapping)
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, seq_len) in enumerate(zip(ctx.query_lens_cpu, ctx.seq_lens_cpu)):
        keys, values = _context(kv, ctx.block_tables[i], seq_len, q.dtype)
        out[start:start + qlen] = _attend(q[start:start + qlen], keys, values, seq_len, scale, window,
                                          softcap, sinks)
        start += qlen
    return out


def _context(kv: KVLayerView, table: torch.Tensor, seq_len: int, dtype: torch.dtype):
    slots = kv_slots(table, torch.arange(seq_len, device=table.device), kv.block_size)
    caches = [kv.k_cache.flatten(0, 1)[slots], kv.v_cache.flatten(0, 1)[slots]]
    if kv.quantized:
        caches = [dequantize_kv(c, s.flatten(0, 1)[slots], dtype) for c, s in zip(caches, (kv.k_scale, kv.v_scale))]
    return caches


def _attend(q, keys, values, seq_len, scale, window, softcap, sinks):
    qlen, heads, _ = q.shape
    group = heads // keys.shape[1]
    keys = keys.repeat_interleave(group, 1).transpose(0, 1).to(q.dtype)  # [H, S, D]
    values = values.repeat_interleave(group, 1).transpose(0, 1).to(q.dtype)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # [H, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # a learned logit per head in the softmax's denominator (GPT-OSS)
        sink = sinks.to(scores.dtype).view(heads, 1, 1).expand(heads, qlen, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.matmul(probs, values).transpose(0, 1)  # [L, H, D]


def register(transformers: Any) -> None:
    """Register the attention and mask functions under ``NAME`` (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(NAME, lmplug_attention)
    AttentionMaskInterface.register(NAME, no_mask)
