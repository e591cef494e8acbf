"""``paged``: PagedAttention over the ``paged`` KV layout (vLLM's kernels, in Triton and PyTorch).

Per layer and step: write the new K/V into their slots (``reshape_and_cache``),
then one batched decode call for the decode sequences (ordered first in the
step) and one varlen prefill call for the rest, both reading K/V through the
block tables. On CPU the decode call also takes every token of the short queries
that follow the decodes (speculative verifies, small chunks) as a decode row of
its own (``paged_rows.py``); with the native kernel, by default (``cpu_rows: all``),
every query: a token's attention then depends on its context only, so a prefix-cache
hit (whose suffix is a short query over a long cache) gives the bits a full prefill
gives. Triton kernels (the write and the decode shared with
``flash``: ``kv_ops``, ``decode_ops``; the prefill: ``paged_prefill_kernels``) run
on CUDA; PyTorch is the CPU default: the write ``kv_ref``, the prefill
``paged_torch``, the decode batch the fused C kernel (``paged_native.py``, option
``cpu_kernel``) or the gather + matmul path (``paged_cpu.py``), and ``decode_ref``
for quantized KV. What every layer of a step reuses (the decode rows, the CPU
decode's tables, the prefill's arguments) is built once per step by ``prepare``.
Quantized KV (kvcache ``dtype: int8 | fp8_e4m3``): the view's scales go to
every op; writes quantize, reads dequantize per tile.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal

import torch
from lmplug_attention.paged.rows import MAX_QUERY_LEN, QueryRows, leading_short_queries, query_rows
from lmplug_attention.sdpa import KV_DTYPES
from pydantic import Field, field_validator

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
from lmplug.errors import ConfigError
from lmplug.kit import extras
from lmplug.kit.native import NativeCall

logger = logging.getLogger(__name__)
ALL_QUERIES = 1 << 62  # cpu_rows "all": no query is too long to be read as rows
_warned: set[str] = set()  # reasons already logged, so a fallback warns once per process


class PagedAttentionOptions(BackendOptions):
    kernels: Literal["auto", "triton", "torch"] = Field(
        default="auto", description="auto: Triton on CUDA, the PyTorch reference on CPU")
    partition_size: int | None = Field(
        default=None, description="decode split-K partition in tokens (a power of two >= 16; 0: never "
                                  "split); None: split only long contexts in small batches (Triton)")
    cpu_rows: Literal["all", "short"] = Field(
        default="all", description="CPU with the native kernel: all = every query token is a row of the C "
                                   "kernel, so a token's attention depends only on its context (a prefix-cache "
                                   "hit, a prefill chunk or a batch never changes an output); short = only "
                                   "queries of up to 32 tokens, longer ones take the varlen prefill's matmuls "
                                   "(faster prefill with several threads, but a prefix hit can then change "
                                   "greedy tokens: the packed GGUF path's 8-bit activations amplify the "
                                   "kernels' float rounding)")
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
    from lmplug_attention import decode_ref, kv_ref
    from lmplug_attention.paged import cpu as paged_cpu
    from lmplug_attention.paged import torch_path as paged_torch

    return SimpleNamespace(write=kv_ref.reshape_and_cache, decode=decode_ref.decode_attention,
                           prefill=paged_torch.paged_prefill_attention, cpu_decode=paged_cpu, native=None)


def _native_kernel(cpu_kernel: str):
    """The C decode kernel (``paged_native.NativeKernel``) when ``cpu_kernel`` asks for it and it
    builds here, else None; ``native`` that cannot build is a ConfigError, ``auto`` falls back
    with a warning."""
    if cpu_kernel == "torch":
        return None
    from lmplug_attention.paged import native as paged_native

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


def _triton_ops(device: torch.device, partition_size: int | None) -> SimpleNamespace:
    if device.type != "cuda":
        _check_interpreter()
    from lmplug_attention import kv_ops
    from lmplug_attention.paged import kernels as paged_kernels
    from lmplug_attention.paged import prefill_kernels as paged_prefill_kernels

    decode = functools.partial(paged_kernels.paged_decode_attention, partition_size=partition_size)
    return SimpleNamespace(write=kv_ops.reshape_and_cache, decode=decode,
                           prefill=paged_prefill_kernels.paged_prefill_attention, cpu_decode=None, native=None)


@dataclass
class PagedStepMetadata:
    """What every layer of one step reuses, built by ``PagedAttention.prepare``."""

    ops: SimpleNamespace  # the kernel set of the cache's device (``PagedAttention.ops``)
    rows: QueryRows  # query rows [0, rows.num_tokens) go to the decode call
    # the decode's per-step tables: the C kernel's (``paged_native.prepare``) when it decodes,
    # else ``paged_cpu``'s gather index when that decodes; neither for the other decode ops
    native_batch: object | None = None
    cpu_index: object | None = None
    cpu_key: tuple = ()  # the (window, KV heads) ``cpu_index`` was built for
    # paged_cpu's gather indexes of the other (window, KV heads) of a model whose layers differ
    cpu_by_window: dict = field(default_factory=dict)
    # the prefill call's arguments over sequences [rows.num_seqs:]; None when there are none
    prefill_args: dict | None = None


class PagedAttention(AttentionBackend, extras.NativeDecode, extras.ShortQueries):
    name = "paged"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        kv_layouts=frozenset({"paged"}),
        # tree_attention: not the Triton kernels (``features_for``); on CPU the
        # native kernel reads trees as masked decode rows, else the PyTorch prefill path masks them.
        # Soft-caps, sinks, windows and scales per layer: every path (Triton, C, PyTorch)
        features=frozenset({"sliding_window", "tree_attention", LAYER_WINDOWS, LAYER_SCALES, LOGIT_SOFTCAP,
                            ATTENTION_SINKS}),
        kv_dtypes=KV_DTYPES,
        priority=20,  # above sdpa, which reads the paged layout too but gathers per sequence
    )
    Options = PagedAttentionOptions
    # CPU: the decode call also takes the short queries after the decodes as rows (paged_rows)
    short_query_tokens = 64

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
            ops = _triton_ops(device, self.options.partition_size) if use_triton else _torch_ops()
            if not use_triton and device.type == "cpu":
                ops.native = _native_kernel(self.options.cpu_kernel)
            self._ops[device.type] = ops
        return self._ops[device.type]

    def prepare(self, ctx: StepContext, kv: KVLayerView) -> PagedStepMetadata:
        """The step's decode rows, the CPU decode's tables or gather index, the prefill's arguments."""
        cache = kv.k_cache
        ops = self.ops(cache.device)
        plain_cpu = ops.cpu_decode is not None and not kv.quantized  # paged_cpu / paged_native decode
        native = plain_cpu and ops.native is not None and cache.dtype in ops.native.dtypes
        rows = self._decode_rows(ctx, ops, trees=native)
        meta = PagedStepMetadata(ops, rows, prefill_args=self._prefill_args(ctx, rows, cache.device))
        if rows.num_tokens and native:
            from lmplug_attention.paged.native import prepare

            meta.native_batch = prepare(rows.block_tables, rows.seq_lens, cache.shape[1], cache.shape[0],
                                        mask_starts=rows.mask_starts, masks=rows.masks)
        elif rows.num_tokens and plain_cpu:
            meta.cpu_index = self._cpu_index(meta, cache, self.sliding_window)
            meta.cpu_key = (self.sliding_window, cache.shape[2])
        return meta

    def _cpu_index(self, meta: PagedStepMetadata, cache: torch.Tensor, window: int | None):
        rows = meta.rows
        return meta.ops.cpu_decode.decode_index(rows.block_tables, rows.seq_lens, cache.shape[1], cache.shape[2],
                                                max(rows.seq_lens_cpu), window)

    def native_decode(self, ctx: StepContext, views: list[KVLayerView]) -> NativeCall | None:
        """A native decode step's attention: the C decode kernel, where this backend decodes
        with it on the CPU (``cpu_kernel`` auto or native, and it builds); layers may differ in
        scale, window and soft-cap, not have sinks."""
        kernel = self.ops(views[0].k_cache.device).native if views else None
        if kernel is None:
            return None
        from lmplug_attention.paged import native as paged_native

        return paged_native.step_attention(ctx, views, self.num_heads, self.num_kv_heads, self.head_dim,
                                           self.scale, self.sliding_window, "attention paged",
                                           () if self.uniform_layers else self.layers, kernel)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext, sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta: PagedStepMetadata = ctx.metadata_for(self, kv)
        spec = self.layer_attention(layer)
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale} if kv.quantized else {}
        # the layer's soft-cap and sinks, for every op (the PyTorch, Triton and C paths all take them)
        features = {"softcap": spec.softcap, "sinks": sinks}
        meta.ops.write(k, v, kv.k_cache, kv.v_cache, ctx.slot_mapping, **scales)
        out = torch.empty_like(q)
        t = meta.rows.num_tokens  # query rows [0, t) read as decode rows, the rest prefill
        if t:
            self._decode(meta, q[:t], kv, out[:t], scales, spec, features)
        if meta.prefill_args is not None:
            meta.ops.prefill(q[t:], kv.k_cache, kv.v_cache, scale=spec.scale, out=out[t:], **scales,
                             **{**meta.prefill_args, "sliding_window": spec.sliding_window}, **features)
        return out

    def _decode(self, meta: PagedStepMetadata, q: torch.Tensor, kv: KVLayerView, out: torch.Tensor,
                scales: dict, spec, features: dict) -> None:
        """The decode rows: the C kernel or ``paged_cpu`` (plain KV on CPU), else ``ops.decode``."""
        window = spec.sliding_window
        if meta.native_batch is not None:
            target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
            meta.ops.native.decode(q.contiguous(), kv.k_cache, kv.v_cache, meta.native_batch, spec.scale,
                                   window, target, **features)
            if target is not out:
                out.copy_(target)
        elif meta.cpu_index is not None:
            # the gather index depends on the window and the layer's KV heads (layers may differ)
            key = (window, kv.k_cache.shape[2])
            index = meta.cpu_index if key == meta.cpu_key else meta.cpu_by_window.get(key)
            if index is None:
                index = meta.cpu_by_window[key] = self._cpu_index(meta, kv.k_cache, window)
            meta.ops.cpu_decode.paged_decode_attention_cpu(q, kv.k_cache, kv.v_cache, index, spec.scale, out=out,
                                                           **features)
        else:
            rows = meta.rows
            meta.ops.decode(q, kv.k_cache, kv.v_cache, rows.block_tables, rows.seq_lens, spec.scale,
                            sliding_window=window, max_seq_len=max(rows.seq_lens_cpu), out=out,
                            **scales, **features)

    def _decode_rows(self, ctx: StepContext, ops: SimpleNamespace, trees: bool) -> QueryRows:
        """The step's rows for the decode call: on CPU every query token of the leading short
        queries (``paged_rows``: decodes, speculative verifies, small chunks, and draft trees
        when ``trees``, the native kernel serving the cache), with the Triton kernels the
        decodes only."""
        if ops.cpu_decode is not None:
            every = trees and self.options.cpu_rows == "all"  # trees: the native kernel serves the cache
            return query_rows(ctx, leading_short_queries(ctx, ALL_QUERIES if every else MAX_QUERY_LEN, trees=trees))
        n = ctx.num_decodes
        return QueryRows(n, n, ctx.block_tables[:n], ctx.seq_lens[:n], ctx.seq_lens_cpu[:n])

    def _prefill_args(self, ctx: StepContext, rows: QueryRows, device: torch.device) -> dict | None:
        """The prefill call's step-wide arguments over the sequences after the decode rows."""
        m, t = rows.num_seqs, rows.num_tokens
        if m == ctx.num_seqs:
            return None
        cu = ctx.cu_query_lens[m:]
        return {"block_tables": ctx.block_tables[m:], "cu_query_lens": cu - t if t else cu,
                "seq_lens": ctx.seq_lens[m:], "sliding_window": self.sliding_window,
                "max_query_len": max(ctx.query_lens_cpu[m:]), **self._tree_args(ctx, m, device)}

    @classmethod
    def check_target(cls, options: PagedAttentionOptions, kv_dtype: str, head_dim: int, dtype: str,
                     capability: tuple[int, int] | None) -> None:
        """The Triton kernels (``kernels`` auto or triton on CUDA) need sm_80+ (bf16 included) and
        head dims up to 256, for any KV dtype; the PyTorch ones (``kernels: torch``) anything."""
        if options.kernels != "torch":
            from lmplug_attention.attn_ops import check_triton_target

            check_triton_target(cls.name, head_dim, dtype, capability, kv_dtype=kv_dtype)

    @classmethod
    def features_for(cls, options: PagedAttentionOptions, device: str) -> frozenset[str]:
        """No "tree_attention" where the Triton kernels run (CUDA, or ``kernels: triton``): tree
        masks are applied by the PyTorch path only."""
        torch_path = options.kernels == "torch" or (options.kernels == "auto" and device != "cuda")
        return cls.capabilities.features - (set() if torch_path else {"tree_attention"})

    def _tree_args(self, ctx: StepContext, n: int, device: torch.device) -> dict:
        """``ctx.query_masks`` renumbered for the prefill call over sequences ``n:`` (trees never
        decode: they have several query tokens)."""
        if not ctx.query_masks:
            return {}
        if "tree_attention" not in self.features_for(self.options, device.type):
            raise RuntimeError("attention: paged: draft trees need kernels='torch' (the Triton "
                               "kernels have no tree mask); the engine refuses this at load time")
        return {"query_masks": {i - n: m for i, m in ctx.query_masks.items()}}
