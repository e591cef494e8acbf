"""``paged``: a pool of fixed-size KV blocks shared by all sequences (PagedAttention's layout).

A sequence holds only the blocks its tokens fill, so memory follows the
tokens actually stored instead of ``max_model_len`` per sequence. The pool
is one tensor ``[layers, 2 (K, V), num_blocks, block_size, Hkv, D]`` (``[layers, 1, ...]``
for the MLA latent, ``KVCacheSpec.latent``); layer
``l``'s view is ``pool[l, 0]`` / ``pool[l, 1]``, the ``[num_blocks,
block_size, Hkv, D]`` shape every attention backend reads. With ``dtype:
int8 | fp8_e4m3`` the pool holds one byte per value and a parallel float32
scale pool ``[layers, 2, num_blocks, block_size, Hkv]`` (one scale per token
and KV head, ``lmplug.interfaces.kvcache.quantize_kv``); copy-on-write copies
both, so prefix caching, forks and truncation work unchanged. The accounting
(free list, refcounts, prefix hashes, LRU of cached blocks) lives in
``block_manager.py``; this file owns the tensors, the pool sizing and the
copies that copy-on-write asks for. On the CPU the pool is in transparent huge pages
(``lmplug.kit.hugemem``): a long context's decode reads all its K/V, in blocks scattered over the
pool, every step (``benchmarks/bench_hugemem.py --cases kv``).
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import torch
from lmplug_kvcache.block_manager import BlockManager
from lmplug_kvcache.layer_groups import LayerGroup, describe, layer_groups
from lmplug_kvcache.swap import Swapped, SwapSpace
from lmplug_kvcache.tier import BlockTier
from pydantic import Field, field_validator

from lmplug.api import (
    BackendOptions,
    Capabilities,
    KVBlockFormat,
    KVCacheBackend,
    KVCacheSpec,
    KVConnector,
    KVLayerView,
    StatePool,
)
from lmplug.errors import ConfigError
from lmplug.kit import hugemem, kv_extras

logger = logging.getLogger(__name__)

CPU_MEMORY_FRACTION = 0.2  # of MemAvailable: the CPU also holds the weights and activations
CUDA_MEMORY_FRACTION = 0.9  # of the memory left free after the weights are loaded


class PagedOptions(BackendOptions):
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per block, a power of two")
    memory_gb: float | None = Field(default=None, gt=0, description="KV pool size in GiB")
    memory_fraction: float | None = Field(
        default=None, gt=0, le=1,
        description=f"share of free memory for the pool when memory_gb is unset (default: "
                    f"{CUDA_MEMORY_FRACTION} on CUDA; {CPU_MEMORY_FRACTION} of MemAvailable on CPU, "
                    f"capped at max_num_seqs x max_model_len tokens)")
    prefix_caching: bool = Field(default=False, description="reuse the K/V of full blocks of shared prefixes")
    swap_space_gb: float = Field(default=4.0, ge=0, description="host memory for the K/V of sequences "
                                 "preempted with `scheduler: {preemption: swap}`")
    num_blocks: int | None = Field(default=None, ge=1, description="pool size in blocks (overrides memory_*)")
    dtype: Literal["auto", "fp8_e4m3", "int8"] = Field(
        default="auto", description="K/V storage: auto = the model dtype; int8 / fp8_e4m3 = one byte per "
                                    "value plus a float32 scale per (token, KV head): ~2x (bf16) or ~4x "
                                    "(fp32) the tokens in the same memory")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two (1, 2, 4, ..., 16, 32, ...), got {value}")
        return value


class PagedKVCache(KVCacheBackend, kv_extras.Forks, kv_extras.SwapSpace, kv_extras.ConnectorTier,
                   kv_extras.CopyRecording, kv_extras.StateSlots, kv_extras.SizedPool, kv_extras.PrefixSharing):
    name = "paged"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), kv_layouts=frozenset({"paged"}),
                                features=frozenset({"fork", "prefix_caching", "sliding_window", "state", "kv_connector", "swap",
                                                  "tp_copies"}),
                                priority=5)
    Options = PagedOptions

    @classmethod
    def kv_dtype_of(cls, options: PagedOptions) -> str:
        return options.dtype

    @classmethod
    def draft_options(cls, options: PagedOptions) -> PagedOptions:
        return options.model_copy(update={"prefix_caching": False})

    @classmethod
    def with_pool_blocks(cls, options: PagedOptions, blocks: int) -> PagedOptions:
        return options.model_copy(update={"num_blocks": blocks})

    def pool_blocks(self) -> int:
        return self.num_blocks

    def __init__(self, options: PagedOptions, spec: KVCacheSpec) -> None:
        spec = spec.with_kv_dtype(options.dtype, self.name)
        super().__init__(options, spec)
        if spec.states and options.prefix_caching:
            raise ConfigError(f"kvcache: paged: prefix_caching cannot serve this model: its state layers "
                              f"({len(spec.states)}, e.g. layer {spec.states[0].layer}, {spec.states[0].kind}) "
                              "keep one running state per sequence, not per-block K/V, and state snapshots "
                              "at block boundaries are not built; set prefix_caching: false")
        self.num_blocks = pool_blocks(options, spec)
        # state layers: one slot per running sequence (the scheduler admits at most max_num_seqs)
        self.states = StatePool(spec.states, spec.max_num_seqs, spec.device) if spec.states else None
        # one pool per group of layers of one (KV heads, head_dim): one for most models, two for
        # Gemma 4's sliding and full layers; every group has the same blocks
        self._pools: list[torch.Tensor] = []
        self._group_scales: list[torch.Tensor] = []
        self._where: dict[int, tuple[int, int]] = {}  # cache layer -> (group, index in it)
        # (a model of state layers only has no cached layer: one empty pool)
        for (heads, dim), layers in (spec.shape_groups or {(spec.num_kv_heads, spec.head_dim): []}).items():
            shape = (len(layers), spec.num_kv_tensors, self.num_blocks, options.block_size, heads, dim)
            # zeros, not empty: attention masks unused slots, but 0 x NaN garbage would still be NaN
            self._pools.append(_zeros(shape, spec.cache_dtype, spec.device))
            # quantized: a float32 scale per (slot, KV head) in the pool's layout without D
            if spec.quantized:
                self._group_scales.append(_zeros(shape[:-1], torch.float32, spec.device))
            self._where.update({layer: (len(self._pools) - 1, i) for i, layer in enumerate(layers)})
        # the first group's: with one group (every layer alike) the whole pool, which swap and a
        # connector's tier move; with several they decline (``swap_out``, ``attach_connector``)
        self._pool = self._pools[0]
        self._scales = self._group_scales[0] if spec.quantized else None
        self._views = [self._view(i) for i in range(spec.num_layers)]
        self.blocks = BlockManager(self.num_blocks, options.block_size,
                                   enable_prefix_caching=options.prefix_caching,
                                   sliding_window=spec.sliding_window)
        self.tier: BlockTier | None = None  # a KV connector's tier of blocks (``attach_connector``)
        self.swap = SwapSpace(int(options.swap_space_gb * 2**30), spec.device)  # preempted sequences' K/V
        self._copies: list[list[tuple[int, int]]] | None = None  # recorded for the other TP ranks
        if spec.layer_windows:
            logger.info("paged KV cache: layer groups %s: one block table per sequence, so windowed layers "
                        "keep the blocks full layers need (layer_groups() reports the bytes)",
                        describe(self.layer_groups()))
        logger.info("paged KV cache: %s, %d bytes/token, %d blocks of %d tokens = %d tokens (%.2f GiB)%s%s",
                    _dtype_name(spec), spec.bytes_per_token, self.num_blocks, options.block_size,
                    self.num_tokens, self.memory_bytes / 2**30,
                    ", prefix caching on" if options.prefix_caching else "",
                    f"; states: {spec.max_num_seqs} slots x {spec.state_bytes_per_seq} bytes "
                    f"({len(spec.states)} layers)" if spec.states else "")

    def layer_groups(self) -> list[LayerGroup]:
        """Per group of layers with one window (``KVCacheSpec.layer_windows``; one group when the
        layers do not differ): the K/V bytes its layers hold now and at most need
        (``layer_groups.py``: one block table per sequence, so no group releases blocks alone)."""
        spec = self.spec
        windows = spec.layer_windows or (spec.sliding_window,) * spec.num_layers
        block_bytes = [spec.layer_bytes_per_token(i) * self.options.block_size for i in range(spec.num_layers)]
        return layer_groups(windows, self.options.block_size, block_bytes, self.blocks.held_counts())

    def _view(self, layer: int) -> KVLayerView:
        group, index = self._where[layer]
        pool, spec = self._pools[group][index], self.spec
        # the latent layout (MLA) has one tensor per layer and no V: attention gets an empty view
        v = pool[0, ..., :0] if spec.latent else pool[1]
        if not spec.quantized:
            return KVLayerView(pool[0], v, "paged")
        scales = self._group_scales[group][index]
        return KVLayerView(pool[0], v, "paged", scales[0], scales[1])

    # -- layout -----------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        return "paged"

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    @property
    def memory_bytes(self) -> int:
        """The K/V pool, its scales and the state slots."""
        states = 0 if self.states is None else self.states.nbytes
        return sum(t.numel() * t.element_size() for t in self._pools + self._group_scales) + states

    def layer_view(self, layer: int) -> KVLayerView:
        return self._views[layer]

    # -- accounting -------------------------------------------------------------------------
    def can_allocate(self, seq, num_tokens: int) -> bool:
        if num_tokens > self.spec.max_model_len:
            return False
        if self.states is not None and not self.states.can_take(seq.seq_id):
            return False
        return self.blocks.can_allocate(seq.seq_id, seq.token_ids, num_tokens, seq.num_computed_tokens,
                                        getattr(seq, "cache_salt", None))

    def allocate(self, seq, num_tokens: int) -> int:
        if self.states is not None and not self.states.can_take(seq.seq_id):
            raise RuntimeError(f"paged KV cache: no free state slot for sequence {seq.seq_id} "
                               f"({self.states.num_slots} slots)")
        alloc = self.blocks.allocate(seq.seq_id, seq.token_ids, num_tokens, seq.num_computed_tokens,
                                     getattr(seq, "cache_salt", None))
        if alloc.copies:
            self._copy_blocks(alloc.copies)
        if self.states is not None:
            self.states.take(seq.seq_id)
        cached = alloc.num_cached_tokens
        if self.tier is not None:
            if alloc.loads:  # prefix blocks the tier holds: filled before the step, or computed
                cached = self.blocks.loaded(seq.seq_id, self.tier.load(alloc.loads))
            self.tier.save(self.blocks.drain_registered())
        return cached

    def free(self, seq) -> None:
        self.swap.drop(seq.seq_id)
        self.blocks.free(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if self.states is not None:
            self.states.release(seq.seq_id)
        if self.tier is not None:
            self.tier.save(self.blocks.drain_registered())

    # -- swap preemption ----------------------------------------------------------------------
    def swap_out(self, seq) -> bool:
        computed = seq.num_computed_tokens
        # a sliding window releases leading blocks as it goes, and layers of different shapes
        # (several pools) are not swapped: recompute instead
        if (computed == 0 or self.spec.sliding_window is not None or len(self._pools) > 1
                or not self.blocks.has_seq(seq.seq_id)):
            return False
        table = self.blocks.block_table(seq.seq_id)[:-(-computed // self.block_size)]
        idx = torch.tensor(table, device=self._pool.device)
        pool = self._pool.view(torch.uint8) if self._pool.dtype == torch.float8_e4m3fn else self._pool
        nbytes = (pool[:, :, :1].numel() * pool.element_size()
                  + (0 if self._scales is None else self._scales[:, :, :1].numel() * 4)) * len(table)
        nbytes += self.spec.state_bytes_per_seq
        if not self.swap.fits(nbytes):
            return False
        swapped = Swapped(computed, self.swap.to_host(pool[:, :, idx]),
                          None if self._scales is None else self.swap.to_host(self._scales[:, :, idx]),
                          None if self.states is None else self.states.snapshot(seq.seq_id))
        self.free(seq)
        self.swap.store(seq.seq_id, swapped)
        return True

    def is_swapped(self, seq) -> bool:
        return seq.seq_id in self.swap

    def swap_in(self, seq) -> None:
        swapped = self.swap.take(seq.seq_id)
        if seq.num_computed_tokens != swapped.num_tokens:
            raise RuntimeError(f"paged KV cache: sequence {seq.seq_id} was swapped out with "
                               f"{swapped.num_tokens} computed tokens, comes back with {seq.num_computed_tokens}")
        # prefix-cache hits (pool or tier) already hold these tokens' K/V; the rest comes back
        first = self.allocate(seq, swapped.num_tokens) // self.block_size
        table = self.blocks.block_table(seq.seq_id)[first:swapped.kv.shape[2]]
        if table:
            idx = torch.tensor(table, device=self._pool.device)
            pool = self._pool.view(torch.uint8) if self._pool.dtype == torch.float8_e4m3fn else self._pool
            pool[:, :, idx] = swapped.kv[:, :, first:].to(pool.device)
            if self._scales is not None:
                self._scales[:, :, idx] = swapped.scales[:, :, first:].to(self._scales.device)
        if self.states is not None:
            self.states.release(seq.seq_id)  # allocate took a zeroed slot
            self.states.restore(seq.seq_id, swapped.state)

    def attach_connector(self, connector: KVConnector, model: str) -> None:
        if not self.options.prefix_caching:
            raise ConfigError(f"kvconnector: {connector.name}: the paged KV cache moves blocks to and from a "
                              "tier by their prefix hash, which needs kvcache.prefix_caching: true")
        spec = self.spec
        if len(self._pools) > 1:
            raise ConfigError(f"kvconnector: {connector.name}: the paged KV cache of this model holds layers of "
                              f"{len(self._pools)} shapes (KV heads x head_dim: "
                              f"{', '.join(f'{h}x{d}' for h, d in spec.shape_groups)}); a tier of blocks "
                              "is built for one shape only: remove the kvconnector section")
        layout = (f"paged bs={self.block_size} layers={spec.num_layers} tensors={spec.num_kv_tensors} "
                  f"kv_heads={spec.num_kv_heads} head_dim={spec.head_dim} {_dtype_name(spec)}")
        self.tier = BlockTier(connector, KVBlockFormat(model, layout), self._pool, self._scales)
        self.blocks.set_tier(connector.contains)

    def close(self) -> None:
        if self.tier is not None:
            self.tier.connector.close()

    def truncate(self, seq, num_tokens: int) -> None:
        self.blocks.truncate(seq.seq_id, num_tokens)

    def fork(self, parent, child) -> None:
        if self.states is not None and not self.states.can_take(child.seq_id):
            raise RuntimeError(f"paged KV cache: no free state slot to fork sequence {parent.seq_id} "
                               f"into {child.seq_id} ({self.states.num_slots} slots)")
        self.blocks.fork(parent.seq_id, child.seq_id)
        if self.states is not None:
            self.states.copy(parent.seq_id, child.seq_id)

    def block_table(self, seq) -> list[int]:
        return self.blocks.block_table(seq.seq_id)

    @property
    def usage(self) -> float:
        return self.blocks.num_used_blocks / self.num_blocks

    def record_copies(self) -> None:
        self._copies = []

    def take_copies(self) -> list[list[tuple[int, int]]] | None:
        copies, self._copies = self._copies or None, None if self._copies is None else []
        return copies

    def apply_copies(self, copies: list[list[tuple[int, int]]]) -> None:
        for batch in copies:
            self._copy_blocks(batch)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V, and their scales) before a sequence writes
        into its own copy."""
        if self._copies is not None:
            self._copies.append(copies)
        src = torch.tensor([s for s, _ in copies], device=self._pool.device)
        dst = torch.tensor([d for _, d in copies], device=self._pool.device)
        for pool in self._pools:
            # CPU index_put has no float8 kernel: copy the bytes
            pool = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
            pool[:, :, dst] = pool[:, :, src]
        for scales in self._group_scales:
            scales[:, :, dst] = scales[:, :, src]


def _dtype_name(spec: KVCacheSpec) -> str:
    return spec.kv_dtype if spec.quantized else str(spec.dtype).removeprefix("torch.")


def pool_blocks(options: PagedOptions, spec: KVCacheSpec) -> int:
    """How many blocks the pool gets: ``num_blocks``, else ``memory_gb``, else a share of free memory."""
    if options.num_blocks is not None:
        return options.num_blocks
    block_bytes = spec.bytes_per_token * options.block_size
    if options.memory_gb is not None:
        budget, what = options.memory_gb * 2**30, f"memory_gb={options.memory_gb}"
    else:
        budget, what = _default_budget(options, spec), "memory_fraction"
    states = spec.max_num_seqs * spec.state_bytes_per_seq  # one state slot per sequence, first
    if states and states > budget:
        raise ConfigError(f"kvcache: paged: {what} gives {budget / 2**30:.3f} GiB, less than the state "
                          f"slots of max_num_seqs={spec.max_num_seqs} sequences x {spec.state_bytes_per_seq} "
                          f"bytes ({len(spec.states)} state layers) = {states / 2**30:.3f} GiB; raise "
                          "memory_gb or lower scheduler.max_num_seqs")
    budget -= states
    if block_bytes == 0:  # state layers only (a pure SSM): blocks count positions, they hold no bytes
        return spec.max_num_seqs * -(-spec.max_model_len // options.block_size)
    num_blocks = int(budget // block_bytes)
    if num_blocks < 1:
        raise ConfigError(f"kvcache: paged: {what} gives {budget / 2**30:.3f} GiB"
                          f"{' after the state slots' if states else ''}, less than one block "
                          f"of {options.block_size} tokens ({block_bytes} bytes); raise memory_gb or "
                          f"memory_fraction, or set num_blocks")
    return num_blocks  # a pool under max_model_len: the engine clamps max_model_len (a warning)


def _default_budget(options: PagedOptions, spec: KVCacheSpec) -> float:
    if spec.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(spec.device)
        return (options.memory_fraction or CUDA_MEMORY_FRACTION) * free
    budget = (options.memory_fraction or CPU_MEMORY_FRACTION) * _mem_available()
    if options.memory_fraction is None:
        # by default never more than every sequence at full length would need
        budget = min(budget, spec.max_num_seqs * (spec.max_model_len * spec.bytes_per_token
                                                  + spec.state_bytes_per_seq))
    return budget


def _mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (what Linux can hand out without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ConfigError("kvcache: paged: cannot read MemAvailable from /proc/meminfo; "
                      "set memory_gb or num_blocks")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool tensor; on the CPU in huge-page memory (``torch.zeros`` elsewhere)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return hugemem.empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape).zero_()
