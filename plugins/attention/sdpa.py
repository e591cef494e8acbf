"""``sdpa``: the PyTorch reference attention, the CPU default and the ground truth.

Writes the step's K/V into the cache through the slot mapping, then runs
``torch.nn.functional.scaled_dot_product_attention`` per sequence over its
cached context. Reads both the contiguous and the paged layout (a sequence's
blocks are gathered through its block table). GQA without repeating K/V:
decode queries are grouped per KV head; prefill uses SDPA's ``enable_gqa``.
Quantized KV (kvcache ``dtype: int8 | fp8_e4m3``): writes quantize per
(token, KV head); reads dequantize only the rows of the sequence's context.
Tree attention (feature ``tree_attention``, for tree speculative decoding): a
sequence in ``ctx.query_masks`` attends to its cached context plus the new tokens
its ancestor mask allows (``causal_mask(..., tree=...)``). Soft-capped scores (Gemma 2) and
attention sinks (GPT-OSS: ``forward(..., sinks=)``, a learned logit per head in the softmax
denominator) take an explicit math path (``explicit_attention``).

Per step (``prepare``): each sequence's attention mask, built once and read by
every layer. A native decode step (``native_decode``: the core runs a float32 CPU decode
step's layers in one C call) attends through the family's C decode kernel instead, to
float rounding the same result. ``context_kv`` and ``attend`` also serve the ``paged`` backend's
PyTorch prefill (``paged_torch``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lmplug_attention.kv_ref import gather_context
from lmplug_attention.paged import native as paged_native
from lmplug_attention.prefill_ref import sink_softmax

from lmplug.api import (
    ATTENTION_SINKS,
    LAYER_SCALES,
    LAYER_WINDOWS,
    LOGIT_SOFTCAP,
    AttentionBackend,
    Capabilities,
    KVLayerView,
    StepContext,
)
from lmplug.kit import extras
from lmplug.kit.kv_quant import dequantize_kv, store_kv
from lmplug.kit.native import NativeCall

# the kvcache `dtype` values the first-party dense backends read
KV_DTYPES = frozenset({"auto", "int8", "fp8_e4m3"})


@dataclass
class SdpaStepMetadata:
    """What every layer of one step reuses: per sequence, the bool [qlen, seq_len] mask its
    queries attend with, or None where none is needed (a plain causal prompt, or a decode
    without a window: SDPA then runs unmasked)."""

    masks: list[torch.Tensor | None]
    # each sequence's first cache block (a Python int, read once a step, not once a layer)
    first_blocks: list[int]
    # the masks of the other windows of a model with a window per layer (built on first use)
    by_window: dict[int | None, list[torch.Tensor | None]] = field(default_factory=dict)


class SdpaAttention(AttentionBackend, extras.NativeDecode):
    name = "sdpa"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        kv_layouts=frozenset({"contiguous", "paged"}),
        features=frozenset({"sliding_window", "tree_attention", LAYER_WINDOWS, LAYER_SCALES, LOGIT_SOFTCAP,
                            ATTENTION_SINKS}),
        kv_dtypes=KV_DTYPES,
        priority=10,
    )

    def prepare(self, ctx: StepContext, kv: KVLayerView) -> SdpaStepMetadata:
        masks = step_masks(ctx, self.sliding_window, kv.k_cache.device)
        return SdpaStepMetadata(masks, ctx.block_tables[:, 0].tolist() if ctx.block_tables.shape[-1] else [],
                                {self.sliding_window: masks})

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta: SdpaStepMetadata = ctx.metadata_for(self, kv)
        spec = self.layer_attention(layer)
        masks = meta.by_window.get(spec.sliding_window)
        if masks is None:
            masks = meta.by_window[spec.sliding_window] = step_masks(ctx, spec.sliding_window, q.device)
        write_kv(kv, k, v, ctx.slot_mapping)
        seq_lens = ctx.seq_lens_cpu
        if len(seq_lens) == 1 and q.shape[0] == 1 and masks[0] is None:  # batch-1 decode
            ctx_k, ctx_v = context_kv(kv.k_cache, kv.v_cache, ctx.block_tables[0], seq_lens[0],
                                      kv.k_scale, kv.v_scale, q.dtype, meta.first_blocks[0])
            return self._decode(q[0], ctx_k, ctx_v, spec.scale, spec.softcap, sinks)[None]
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, seq_len) in enumerate(zip(ctx.query_lens_cpu, seq_lens)):
            ctx_k, ctx_v = context_kv(kv.k_cache, kv.v_cache, ctx.block_tables[i], seq_len,
                                      kv.k_scale, kv.v_scale, q.dtype, meta.first_blocks[i])
            qi = q[start:start + qlen]
            if masks[i] is None and qlen == 1:
                out[start] = self._decode(qi[0], ctx_k, ctx_v, spec.scale, spec.softcap, sinks)
            else:
                out[start:start + qlen] = attend(qi, ctx_k, ctx_v, seq_len, spec.scale, masks[i], spec.softcap,
                                                 sinks)
            start += qlen
        return out

    def native_decode(self, ctx: StepContext, views: list[KVLayerView]) -> NativeCall | None:
        """A native decode step's attention: the family's C decode kernel (``paged_native``),
        which reads this backend's contiguous and paged layouts alike; float32 caches only, and
        layers without sinks (scales, windows and soft-caps may differ by layer)."""
        kernel = self._step_kernel
        if kernel is None:
            return None
        return paged_native.step_attention(ctx, views, self.num_heads, self.num_kv_heads, self.head_dim,
                                           self.scale, self.sliding_window, "attention sdpa",
                                           () if self.uniform_layers else self.layers, kernel)

    @functools.cached_property
    def _step_kernel(self) -> paged_native.NativeKernel | None:
        """The family's C decode kernel, loaded on the first native step and kept (``load()``
        reads three environment variables: tens of microseconds a step once the weights have
        swept the caches); None where it is not built here."""
        try:
            return paged_native.load()
        except paged_native.NativeKernelUnavailable:
            return None

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [H, D] -> [Hkv, G, D]; k, v: [S, Hkv, D] -> [Hkv, S, D]; no mask: all S keys are visible
        # (the layer's own KV heads and head_dim: layers may differ, Gemma 4)
        hkv, dim = k.shape[1], q.shape[-1]
        qg = q.view(hkv, -1, dim)
        if softcap is not None or sinks is not None:
            return explicit_attention(qg, k.transpose(0, 1), v.transpose(0, 1), None, scale, softcap,
                                      sinks).reshape(-1, dim)
        # 4-d (a batch of one): on CPU, 3-d inputs miss SDPA's flash kernel and take the math path
        o = F.scaled_dot_product_attention(qg[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           scale=scale)
        return o.reshape(-1, dim)


def step_masks(ctx: StepContext, window: int | None, device: torch.device) -> list[torch.Tensor | None]:
    """Per sequence of the step, the bool [qlen, seq_len] mask its queries attend with under
    ``window``, or None where none is needed (a plain causal prompt, a decode without a window)."""
    masks = []
    for i, (qlen, seq_len) in enumerate(zip(ctx.query_lens_cpu, ctx.seq_lens_cpu)):
        tree = ctx.query_masks.get(i)
        plain = tree is None and window is None and qlen in (1, seq_len)
        masks.append(None if plain else causal_mask(qlen, seq_len, window, device, tree))
    return masks


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention in explicit math, over grouped heads: q [Hkv, G, L, D] or [Hkv, G, D] (one query),
    k, v [Hkv, S, D], ``mask`` bool [L, S] (True = attend) -> like q. ``softcap``: scores
    ``softcap * tanh(q.k * scale / softcap)`` (Gemma 2). ``sinks`` [H] (head h = kv head h // G,
    group member h % G): ``exp(sinks[h])`` joins each row's softmax denominator, with no value
    (GPT-OSS), so a row's weights sum to less than one."""
    one = q.dim() == 3
    qq = q.unsqueeze(2) if one else q
    scores = torch.matmul(qq, k.unsqueeze(1).transpose(-1, -2)).float() * scale  # [Hkv, G, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = sink_softmax(scores, None if sinks is None else sinks.view(*scores.shape[:2], 1, 1))
    out = torch.matmul(probs.to(v.dtype), v.unsqueeze(1))
    return out.squeeze(2) if one else out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float,
           mask: torch.Tensor | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [L, H, D], the last L positions of a context k, v [S, Hkv, D] -> [L, H, D]: SDPA with
    ``mask`` (bool [L, S], True = attend; ``causal_mask``), plain causal when it is None;
    scores soft-capped at ``softcap`` and sinks [H] joined to the softmax where given
    (``explicit_attention``)."""
    if mask is None and q.shape[0] != seq_len:
        raise ValueError(f"attend: without a mask the queries must be the whole context ({seq_len}), "
                         f"got {q.shape[0]}")
    if softcap is not None or sinks is not None:
        length, heads, dim = q.shape
        hkv = k.shape[1]
        qg = q.permute(1, 0, 2).reshape(hkv, heads // hkv, length, dim)
        if mask is None:
            mask = causal_mask(length, seq_len, None, q.device)
        out = explicit_attention(qg, k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap,
                                 sinks)  # [Hkv, G, L, D]
        return out.reshape(heads, length, dim).transpose(0, 1)
    # 4-d (a batch of one): on CPU, 3-d inputs miss SDPA's flash kernel and take the math path
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def write_kv(kv: KVLayerView, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V: slot s is row s of the cache flattened to [slots, Hkv, D]
    (quantized per (token, KV head), scales alongside, when the cache is)."""
    store_kv(kv.k_cache, kv.k_scale, k, slot_mapping)
    store_kv(kv.v_cache, kv.v_scale, v, slot_mapping)


def context_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               dtype: torch.dtype | None = None, first_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V, [seq_len, Hkv, D] each, through its block table [max_blocks]
    (a view when it fits one block and is not quantized; quantized K/V are dequantized to ``dtype``).
    ``first_block``: ``block_table[0]`` where the caller has it as an int already."""
    if seq_len > k_cache.shape[1]:
        table = block_table[None]
        return (gather_context(k_cache, table, seq_len, k_scale, dtype)[0],
                gather_context(v_cache, table, seq_len, v_scale, dtype)[0])
    b = int(block_table[0]) if first_block is None else first_block
    k, v = k_cache[b, :seq_len], v_cache[b, :seq_len]
    if k_scale is None:
        return k, v
    dtype = dtype or torch.float32
    return dequantize_kv(k, k_scale[b, :seq_len], dtype), dequantize_kv(v, v_scale[b, :seq_len], dtype)


def causal_mask(qlen: int, seq_len: int, window: int | None, device: torch.device,
                tree: torch.Tensor | None = None) -> torch.Tensor:
    """[qlen, seq_len] bool, True = attend. Query i sits at position seq_len - qlen + i.

    ``tree`` (bool [qlen, qlen], ``StepContext.query_masks``): the new tokens are a draft tree's
    root and nodes; new token i sits at position start + depth(i) (depth = its ancestors in the
    mask) and sees the cached keys [0, start) and the new tokens the mask allows; the window
    applies to those positions."""
    start = seq_len - qlen
    if tree is None:
        q_pos = torch.arange(start, seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
        mask = k_pos <= q_pos
    else:
        tree = tree.to(device)
        new_pos = start + tree.sum(1) - 1  # [qlen]: root at start, a node at start + depth
        q_pos = new_pos.unsqueeze(1)
        k_pos = torch.cat([torch.arange(start, device=device), new_pos]).unsqueeze(0)
        mask = torch.cat([torch.ones(qlen, start, dtype=torch.bool, device=device), tree], 1)
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
