"""``flash``: FlashAttention-2 style Triton kernels over the contiguous and the paged KV layouts.

Per layer and step: store the new K/V at ``ctx.slot_mapping`` (``kv_ops.reshape_and_cache``),
then one decode call for the decode sequences (ordered first in the step:
flash decoding, split-K on long contexts) and one varlen prefill call for the
rest. A prefill whose sequences have nothing cached reads K/V straight from
the step's packed tensors; chunked prefills and prefix-cache hits read their
whole context through the block tables. Kernels: ``flash_prefill_kernels.py``
and ``flash_decode_kernels.py`` (the write and the decode kernel are shared with
``paged``: ``kv_ops``, ``decode_ops``); the PyTorch references are ``kv_ref``,
``decode_ref`` and ``prefill_ref``. Each layer attends with its own ``LayerAttention`` (window,
scale, soft-cap) and, where it has them, the ``sinks`` handed to ``forward``. The host-side decisions every layer repeats
(which sequences decode, their longest context, whether the prefill reads the
packed K/V) are made once per step by ``prepare``.

Runs on CUDA. Under ``TRITON_INTERPRET=1`` (tests, the conformance suite) it
also claims the CPU, with a priority below ``sdpa`` so that ``backend: auto``
never picks interpreted kernels; name it to use it there.

Quantized KV (kvcache ``dtype: int8 | fp8_e4m3``): the store quantizes; the
cache-reading kernels dequantize each tile in registers. A fresh prompt's
prefill attends over the step's own (unquantized) K/V, as it always has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from lmplug_attention.sdpa import KV_DTYPES
from pydantic import Field

from lmplug.api import (
    ATTENTION_SINKS,
    LAYER_SCALES,
    LAYER_WINDOWS,
    LOGIT_SOFTCAP,
    AttentionBackend,
    BackendOptions,
    Capabilities,
    KVLayerView,
    StepContext,
)

# read once, as triton does when it is first imported
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SPLITS = 64  # decode_ops.MAX_SPLITS; the kernels (and triton) load with the backend


class FlashAttentionOptions(BackendOptions):
    num_splits: int | None = Field(
        default=None, ge=1, le=MAX_SPLITS,
        description="decode split-K partitions per sequence; None: chosen from context length and "
                    "batch size, 1: never split")


@dataclass
class FlashStepMetadata:
    """What every layer of one step reuses, built by ``FlashAttention.prepare``."""

    num_decodes: int  # sequences [0, num_decodes) decode, one query row each
    max_decode_len: int  # their longest context (0: none)
    max_prefill_len: int  # the longest query after them (0: none)
    packed: bool  # no prefill has a cached prefix: its keys are the step's packed k, v


class FlashAttention(AttentionBackend):
    name = "flash"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        named_devices=frozenset({"cpu"} if _INTERPRETED else ()),  # tests: named, never auto
        kv_layouts=frozenset({"contiguous", "paged"}),
        # each layer's window, scale, soft-cap and sinks (``layer_attention``) go to every kernel
        features=frozenset({"sliding_window", LAYER_WINDOWS, LAYER_SCALES, LOGIT_SOFTCAP, ATTENTION_SINKS}),
        kv_dtypes=KV_DTYPES,
        priority=30,  # above sdpa (10) and paged (20) on CUDA
    )
    Options = FlashAttentionOptions

    def __init__(self, options: FlashAttentionOptions, **kwargs) -> None:
        super().__init__(options, **kwargs)
        from lmplug_attention import kv_ops
        from lmplug_attention.flash import decode_kernels as flash_decode_kernels
        from lmplug_attention.flash import prefill_kernels as flash_prefill_kernels

        self._write = kv_ops.reshape_and_cache
        self._decode = flash_decode_kernels.flash_decode_with_kvcache
        self._prefill = flash_prefill_kernels.flash_prefill_with_kvcache
        self._varlen = flash_prefill_kernels.flash_varlen_attention

    @classmethod
    def check_target(cls, options: FlashAttentionOptions, kv_dtype: str, head_dim: int, dtype: str,
                     capability: tuple[int, int] | None) -> None:
        """Every path is a Triton kernel: sm_80+ (bf16 included), head dims up to 256. Any KV dtype
        under 16-bit queries (fp8 is decoded by integer ops, so an A100 reads an fp8 cache too)."""
        from lmplug_attention.attn_ops import check_triton_target

        check_triton_target(cls.name, head_dim, dtype, capability, kv_dtype=kv_dtype)

    def prepare(self, ctx: StepContext, kv: KVLayerView) -> FlashStepMetadata:
        n = ctx.num_decodes
        prefill_lens = ctx.query_lens_cpu[n:]
        return FlashStepMetadata(n, max(ctx.seq_lens_cpu[:n], default=0), max(prefill_lens, default=0),
                                 prefill_lens == ctx.seq_lens_cpu[n:])

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext, sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta: FlashStepMetadata = ctx.metadata_for(self, kv)
        self._write(k, v, kv.k_cache, kv.v_cache, ctx.slot_mapping, kv.k_scale, kv.v_scale)
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale} if kv.quantized else {}
        spec = self.layer_attention(layer)
        # this layer's window, soft-cap and sinks, for every kernel
        features = {"sliding_window": spec.sliding_window, "softcap": spec.softcap, "sinks": sinks}
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = meta.num_decodes
        if n:
            # decodes own one query row each, so rows [0, n) are theirs
            self._decode(q[:n], kv.k_cache, kv.v_cache, ctx.block_tables[:n], ctx.seq_lens[:n], spec.scale,
                         max_seq_len=meta.max_decode_len, num_splits=self.options.num_splits, out=out[:n],
                         **scales, **features)
        if n == ctx.num_seqs:
            return out
        if meta.packed:  # nothing cached before this step: the keys are exactly the step's packed k, v
            self._varlen(q, k, v, ctx.cu_query_lens, spec.scale, max_seqlen=meta.max_prefill_len, first_seq=n,
                         out=out, **features)
        else:
            self._prefill(q, kv.k_cache, kv.v_cache, ctx.block_tables, ctx.cu_query_lens, ctx.seq_lens,
                          spec.scale, max_query_len=meta.max_prefill_len, first_seq=n, out=out, **scales,
                          **features)
        return out
