"""``mla``: multi-head latent attention (DeepSeek-V2/V3) over the latent KV layout.

The KV cache (contiguous or paged, built with ``KVCacheSpec.latent``) holds one
row ``[latent | k_pe]`` per token and layer. Per layer and step: write the new
rows, then one batched absorbed decode for the decode sequences (ordered first
in the step) and the expanded prefill for the rest (``mla_ref.py`` explains
both). The decode's attention over the latent runs as a Triton kernel
(``mla_kernels.py``) on CUDA and in PyTorch on CPU (``kernels`` option). The
split of the step between the two and their host-side arguments are made once
per step (``prepare``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from lmplug_attention.mla import ref as mla_ref
from pydantic import Field

from lmplug.api import BackendOptions, Capabilities, KVLayerView, MLAAttentionBackend, StepContext
from lmplug.errors import ConfigError


class MLAOptions(BackendOptions):
    kernels: Literal["auto", "triton", "torch"] = Field(
        default="auto", description="decode over the latent: auto = Triton on CUDA, PyTorch on CPU")
    allow_tf32: bool = Field(
        default=False, description="float32 models: let the Triton decode round its dot products' "
                                   "inputs to TF32 (faster on NVIDIA GPUs, ~1e-3 relative error); "
                                   "false: exact fp32")


def _uses_triton(kernels: str, device: str) -> bool:
    return kernels == "triton" or (kernels == "auto" and device == "cuda")


def _decode_latent_op(options: MLAOptions, device: torch.device) -> Callable:
    if not _uses_triton(options.kernels, device.type):
        return mla_ref.mla_decode_latent
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention: mla: kernels='triton' needs a CUDA device (or TRITON_INTERPRET=1 "
                          "set before triton is imported, for tests); use kernels='torch' or 'auto' on CPU")
    from lmplug_attention.mla import kernels as mla_kernels

    return functools.partial(mla_kernels.mla_decode_latent, allow_tf32=options.allow_tf32)


@dataclass
class MLAStepMetadata:
    """What every layer of one step reuses, built by ``MLAAttention.prepare``."""

    num_decodes: int  # sequences [0, num_decodes) take the absorbed decode, one query row each
    max_decode_len: int  # their longest context (0: none)
    prefill_cu: torch.Tensor | None  # the rest's cu_query_lens, from 0; None when there is none


class MLAAttention(MLAAttentionBackend):
    name = "mla"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        kv_layouts=frozenset({"contiguous", "paged"}),
        features=frozenset({"mla"}),
        priority=1,  # `auto` never picks it for ordinary attention; the build picks it for MLA models
    )
    Options = MLAOptions

    def __init__(self, options: MLAOptions, **kwargs) -> None:
        super().__init__(options, **kwargs)
        if self.sliding_window is not None:
            raise ConfigError("attention: mla: sliding-window attention is not supported")
        self._decode_ops: dict[str, Callable] = {}

    @classmethod
    def check_target(cls, options: MLAOptions, kv_dtype: str, head_dim: int, dtype: str,
                     capability: tuple[int, int] | None) -> None:
        """The Triton decode (``kernels`` auto or triton on CUDA) needs sm_80+ (bf16 included);
        ``head_dim`` (the cached row, latent + rope) is not limited: the kernel loads the two
        parts as separate tiles of any width."""
        if _uses_triton(options.kernels, "cuda"):
            from lmplug_attention.attn_ops import check_triton_target

            check_triton_target(cls.name, head_dim, dtype, capability, max_head_dim=None)

    def decode_latent_op(self, device: torch.device) -> Callable:
        if device.type not in self._decode_ops:
            self._decode_ops[device.type] = _decode_latent_op(self.options, device)
        return self._decode_ops[device.type]

    def prepare(self, ctx: StepContext, kv: KVLayerView) -> MLAStepMetadata:
        n = ctx.num_decodes  # decodes come first, one query row each
        cu = ctx.cu_query_lens[n:]
        return MLAStepMetadata(n, max(ctx.seq_lens_cpu[:n], default=0),
                               cu - cu[0] if n < ctx.num_seqs else None)

    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                    k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, kv: KVLayerView,
                    ctx: StepContext) -> torch.Tensor:
        meta: MLAStepMetadata = ctx.metadata_for(self, kv)
        cache = kv.k_cache  # [N, block_size, 1, R + rope]
        mla_ref.write_latent(latent, k_pe, cache, ctx.slot_mapping)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])  # [T, H, V]
        n = meta.num_decodes
        if n:
            out[:n] = mla_ref.mla_decode_attention(
                q_nope[:n], q_pe[:n], w_uk, w_uv, cache, ctx.block_tables[:n], ctx.seq_lens[:n],
                self.scale, decode_latent=self.decode_latent_op(q_nope.device), max_seq_len=meta.max_decode_len)
        if meta.prefill_cu is not None:
            out[n:] = mla_ref.mla_prefill_attention(
                q_nope[n:], q_pe[n:], w_uk, w_uv, cache, ctx.block_tables[n:], meta.prefill_cu,
                ctx.seq_lens[n:], self.scale)
        return out
