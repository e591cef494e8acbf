"""``paged``: PagedAttention over the ``paged`` KV layout (vLLM's kernels, in Triton and PyTorch).

Per layer and step: write the new K/V into their slots (``reshape_and_cache``),
then one batched decode call for the decode sequences (ordered first in the
step) and one varlen prefill call for the rest, both reading K/V through the
block tables. On CPU the decode call also takes every token of the short queries
that follow the decodes (speculative verifies, small chunks) as a decode row of
its own (``paged_rows.py``). Triton kernels (``paged_kernels.py``, ``paged_prefill_kernels.py``)
run on CUDA; their PyTorch twins (``paged_ref.py``) are the CPU default, except for
the decode batch on CPU: the fused C kernel (``paged_native.py``, option
``cpu_kernel``) or the gather + matmul path (``paged_cpu.py``).
Quantized KV (kvcache ``dtype: int8 | fp8_e4m3``): the view's scales go to
every op; writes quantize, reads dequantize per tile.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Literal

import torch
from lmplug_attention.paged_rows import QueryRows, leading_short_queries, query_rows
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

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # reasons already logged, so a fallback warns once per process


class PagedAttentionOptions(BackendOptions):
    kernels: Literal["auto", "triton", "torch"] = Field(
        default="auto", description="auto: Triton on CUDA, the PyTorch reference on CPU")
    partition_size: int | None = Field(
        default=None, description="decode split-K partition in tokens (a power of two >= 16; 0: never "
                                  "split); None: split only long contexts in small batches (Triton)")
    cpu_kernel: Literal["auto", "native", "torch"] = Field(
        default="auto", description="CPU decode: native = the fused C kernel (built with $CC on first "
                                    "use; an error at load when it cannot be); torch = the PyTorch "
                                    "path (paged_cpu); auto = native when it builds, else torch with a "
                                    "one-time warning saying why. Quantized KV always takes PyTorch")

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
                           prefill=paged_ref.paged_prefill_attention, cpu_decode=paged_cpu, native=None)


def _native_kernel(cpu_kernel: str):
    """The C decode kernel (``paged_native.NativeKernel``) when ``cpu_kernel`` asks for it and it
    builds here, else None; ``native`` that cannot build is a ConfigError, ``auto`` falls back
    with a warning."""
    if cpu_kernel == "torch":
        return None
    from lmplug_attention import paged_native

    try:
        return paged_native.load()
    except paged_native.NativeKernelUnavailable as exc:
        why = str(exc)
    if cpu_kernel == "native":
        raise ConfigError(f"attention: paged: attention.cpu_kernel='native' but the native CPU decode "
                          f"kernel is not available: {why}. Use attention.cpu_kernel='auto' or 'torch'")
    if why not in _warned:
        _warned.add(why)
        logger.warning("attention paged: the native CPU decode kernel is not available, using the PyTorch "
                       "path (set attention.cpu_kernel='torch' to silence this): %s", why)
    return None


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
        # tree_attention: not the Triton kernels (``supports_tree_attention``); on CPU the
        # native kernel reads trees as masked decode rows, else the PyTorch prefill path masks them
        features=frozenset({"sliding_window", "tree_attention"}),
        kv_dtypes=KV_DTYPES,
        priority=20,  # above sdpa, which reads the paged layout too but gathers per sequence
    )
    Options = PagedAttentionOptions

    def __init__(self, options: PagedAttentionOptions, **kwargs) -> None:
        super().__init__(options, **kwargs)
        if options.kernels == "triton" and not torch.cuda.is_available():
            _check_interpreter()
        if options.cpu_kernel == "native":
            _native_kernel("native")  # fails here, at engine load, rather than mid-generation
        self._ops: dict[str, SimpleNamespace] = {}

    def ops(self, device: torch.device) -> SimpleNamespace:
        """The kernel set for ``device``: ``write``, ``decode``, ``prefill``."""
        if device.type not in self._ops:
            use_triton = self.options.kernels == "triton" or (self.options.kernels == "auto"
                                                               and device.type == "cuda")
            ops = _triton_ops(device) if use_triton else _torch_ops()
            if not use_triton and device.type == "cpu":
                ops.native = _native_kernel(self.options.cpu_kernel)
            self._ops[device.type] = ops
        return self._ops[device.type]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        ops = self.ops(q.device)
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale} if kv.quantized else {}
        ops.write(k, v, kv.k_cache, kv.v_cache, ctx.slot_mapping, **scales)
        out = torch.empty_like(q)
        rows = self._decode_rows(ctx, ops, kv)
        t = rows.num_tokens  # query rows [0, t) read as decode rows, sequences [rows.num_seqs:] prefill
        if t and ops.cpu_decode is not None and not kv.quantized:
            self._cpu_decode(ops, q[:t], kv, ctx, rows, out[:t])
        elif t:
            ops.decode(q[:t], kv.k_cache, kv.v_cache, rows.block_tables, rows.seq_lens, self.scale,
                       sliding_window=self.sliding_window, max_seq_len=max(rows.seq_lens_cpu),
                       partition_size=self.options.partition_size, out=out[:t], **scales)
        m = rows.num_seqs
        if m < ctx.num_seqs:
            cu = ctx.cu_query_lens[m:]
            ops.prefill(q[t:], kv.k_cache, kv.v_cache, ctx.block_tables[m:], cu - t if t else cu,
                        ctx.seq_lens[m:], self.scale, sliding_window=self.sliding_window,
                        max_query_len=max(ctx.query_lens_cpu[m:]), out=out[t:], **scales,
                        **self._tree_args(ctx, m, q.device))
        return out

    def _decode_rows(self, ctx: StepContext, ops: SimpleNamespace, kv: KVLayerView) -> QueryRows:
        """The step's rows for the decode call, once per step: on CPU every query token of the
        leading short queries (``paged_rows``: decodes, speculative verifies, small chunks, and
        draft trees when the native kernel serves the cache), with the Triton kernels the
        decodes only."""
        rows = ctx.scratch.get((self.name, "rows"))
        if rows is None:
            if ops.cpu_decode is not None:
                trees = ops.native is not None and not kv.quantized and kv.k_cache.dtype in ops.native.dtypes
                rows = query_rows(ctx, leading_short_queries(ctx, trees=trees))
            else:
                n = ctx.num_decodes
                rows = QueryRows(n, n, ctx.block_tables[:n], ctx.seq_lens[:n], ctx.seq_lens_cpu[:n])
            ctx.scratch[(self.name, "rows")] = rows
        return rows

    def supports_tree_attention(self, device: torch.device) -> bool:
        """Tree masks (tree speculative decoding) are applied by the PyTorch prefill path only;
        the Triton kernels (CUDA, or ``kernels: triton``) have no tree mask."""
        return self.options.kernels == "torch" or (self.options.kernels == "auto" and device.type != "cuda")

    def _tree_args(self, ctx: StepContext, n: int, device: torch.device) -> dict:
        """``ctx.tree_masks`` renumbered for the prefill call over sequences ``n:`` (trees never
        decode: they have several query tokens)."""
        if not ctx.tree_masks:
            return {}
        if not self.supports_tree_attention(device):
            raise RuntimeError("attention: paged: draft trees need kernels='torch' (the Triton "
                               "kernels have no tree mask); the engine refuses this at load time")
        return {"tree_masks": {i - n: m for i, m in ctx.tree_masks.items()}}

    def _cpu_decode(self, ops: SimpleNamespace, q: torch.Tensor, kv: KVLayerView, ctx: StepContext,
                    rows: QueryRows, out: torch.Tensor) -> None:
        """The CPU decode: the C kernel (its int32 tables made once per step) when it serves the
        cache dtype, else ``paged_cpu.py`` (its gather index built once per step)."""
        if ops.native is not None and kv.k_cache.dtype in ops.native.dtypes:
            self._native_decode(ops.native, q, kv, ctx, rows, out)
            return
        impl = ops.cpu_decode
        block_size, num_kv_heads = kv.k_cache.shape[1], kv.k_cache.shape[2]
        key = (self.name, block_size, num_kv_heads, self.sliding_window)
        index = ctx.scratch.get(key)
        if index is None:
            index = ctx.scratch[key] = impl.decode_index(
                rows.block_tables, rows.seq_lens, block_size, num_kv_heads, max(rows.seq_lens_cpu),
                self.sliding_window)
        impl.paged_decode_attention_cpu(q, kv.k_cache, kv.v_cache, index, self.scale, out=out)

    def _native_decode(self, native, q: torch.Tensor, kv: KVLayerView, ctx: StepContext, rows: QueryRows,
                       out: torch.Tensor) -> None:
        key = (self.name, "native", kv.k_cache.shape[:2])
        batch = ctx.scratch.get(key)
        if batch is None:  # the same tables and lengths serve every layer (one pool shape per layer)
            from lmplug_attention.paged_native import prepare

            batch = ctx.scratch[key] = prepare(rows.block_tables, rows.seq_lens, kv.k_cache.shape[1],
                                               kv.k_cache.shape[0], mask_starts=rows.mask_starts,
                                               masks=rows.masks)
        target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        native.decode(q.contiguous(), kv.k_cache, kv.v_cache, batch, self.scale, self.sliding_window, target)
        if target is not out:
            out.copy_(target)
