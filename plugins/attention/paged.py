"""``paged``: PagedAttention over the ``paged`` KV layout (vLLM's kernels, in Triton and PyTorch).

Per layer and step: write the new K/V into their slots (``reshape_and_cache``),
then one batched decode call for the decode sequences (ordered first in the
step) and one varlen prefill call for the rest, both reading K/V through the
block tables. Triton kernels (``paged_kernels.py``, ``paged_prefill_kernels.py``)
run on CUDA; their PyTorch twins (``paged_ref.py``) are the CPU default.
Quantized KV (kvcache ``dtype: int8 | fp8_e4m3``): the view's scales go to
every op; writes quantize, reads dequantize per tile.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Literal

import torch
from lmplug_attention.sdpa import KV_DTYPES
from pydantic import Field, field_validator

from lmplug.errors import ConfigError
from lmplug.interfaces import (
    AttentionBackend,
    BackendOptions,
    Capabilities,
    KVLayerView,
    StepContext,
)


class PagedAttentionOptions(BackendOptions):
    kernels: Literal["auto", "triton", "torch"] = Field(
        default="auto", description="auto: Triton on CUDA, the PyTorch reference on CPU")
    partition_size: int | None = Field(
        default=None, description="decode split-K partition in tokens (a power of two >= 16; 0: never "
                                  "split); None: split only long contexts in small batches (Triton)")

    @field_validator("partition_size")
    @classmethod
    def _power_of_two(cls, value: int | None) -> int | None:
        if value not in (None, 0) and (value < 16 or value & (value - 1)):
            raise ValueError(f"partition_size must be None, 0 (never split) or a power of two >= 16 "
                             f"(16, 32, ..., 512), got {value}")
        return value


def _torch_ops() -> SimpleNamespace:
    from lmplug_attention import paged_cpu, paged_ref

    return SimpleNamespace(write=paged_ref.reshape_and_cache, decode=paged_ref.paged_decode_attention,
                           prefill=paged_ref.paged_prefill_attention, cpu_decode=paged_cpu)


def _check_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention: paged: kernels='triton' needs a CUDA device (or TRITON_INTERPRET=1 "
                          "set before triton is imported, for tests); use kernels='torch' or 'auto' on CPU")


def _triton_ops(device: torch.device) -> SimpleNamespace:
    if device.type != "cuda":
        _check_interpreter()
    from lmplug_attention import paged_kernels, paged_prefill_kernels

    return SimpleNamespace(write=paged_kernels.reshape_and_cache, decode=paged_kernels.paged_decode_attention,
                           prefill=paged_prefill_kernels.paged_prefill_attention, cpu_decode=None)


class PagedAttention(AttentionBackend):
    name = "paged"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        kv_layouts=frozenset({"paged"}),
        features=frozenset({"sliding_window"}),
        kv_dtypes=KV_DTYPES,
        priority=20,  # above sdpa, which reads the paged layout too but gathers per sequence
    )
    Options = PagedAttentionOptions

    def __init__(self, options: PagedAttentionOptions, **kwargs) -> None:
        super().__init__(options, **kwargs)
        if options.kernels == "triton" and not torch.cuda.is_available():
            _check_interpreter()
        self._ops: dict[str, SimpleNamespace] = {}

    def ops(self, device: torch.device) -> SimpleNamespace:
        """The kernel set for ``device``: ``write``, ``decode``, ``prefill``."""
        if device.type not in self._ops:
            use_triton = self.options.kernels == "triton" or (self.options.kernels == "auto"
                                                               and device.type == "cuda")
            self._ops[device.type] = _triton_ops(device) if use_triton else _torch_ops()
        return self._ops[device.type]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        ops = self.ops(q.device)
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale} if kv.quantized else {}
        ops.write(k, v, kv.k_cache, kv.v_cache, ctx.slot_mapping, **scales)
        out = torch.empty_like(q)
        n = ctx.num_decodes  # decodes come first, one query row each
        if n and ops.cpu_decode is not None and not kv.quantized:
            self._cpu_decode(ops.cpu_decode, q[:n], kv, ctx, out[:n])
        elif n:
            ops.decode(q[:n], kv.k_cache, kv.v_cache, ctx.block_tables[:n], ctx.seq_lens[:n], self.scale,
                       sliding_window=self.sliding_window, max_seq_len=max(ctx.seq_lens_cpu[:n]),
                       partition_size=self.options.partition_size, out=out[:n], **scales)
        if n < ctx.num_seqs:
            cu = ctx.cu_query_lens[n:]
            ops.prefill(q[n:], kv.k_cache, kv.v_cache, ctx.block_tables[n:], cu - n if n else cu,
                        ctx.seq_lens[n:], self.scale, sliding_window=self.sliding_window,
                        max_query_len=max(ctx.query_lens_cpu[n:]), out=out[n:], **scales)
        return out

    def _cpu_decode(self, impl, q: torch.Tensor, kv: KVLayerView, ctx: StepContext, out: torch.Tensor) -> None:
        """The CPU decode path (``paged_cpu.py``); its gather index is built once per step."""
        block_size, num_kv_heads = kv.k_cache.shape[1], kv.k_cache.shape[2]
        key = (self.name, block_size, num_kv_heads, self.sliding_window)
        index = ctx.scratch.get(key)
        if index is None:
            n = q.shape[0]
            index = ctx.scratch[key] = impl.decode_index(
                ctx.block_tables[:n], ctx.seq_lens[:n], block_size, num_kv_heads, max(ctx.seq_lens_cpu[:n]),
                self.sliding_window)
        impl.paged_decode_attention_cpu(q, kv.k_cache, kv.v_cache, index, self.scale, out=out)
