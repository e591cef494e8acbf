"""``contiguous``: one preallocated row of ``max_model_len`` slots per running sequence.

With a sliding-window model the row is a ring buffer instead: position ``p``
lives in slot ``p % ring`` where ``ring = window + max_num_batched_tokens - 1``
(enough for the window behind the first query of a step plus the step's own
tokens), so memory per sequence is bounded by the window. The block table
lists the row once per ``ring`` positions, so the usual ``table[p // size] *
size + p % size`` addressing lands in the ring; attention never reads a
position older than the window, which is what the ring has overwritten.

``dtype: int8 | fp8_e4m3`` stores K/V quantized per (token, KV head) with
float32 scales in parallel ``[rows, slots, Hkv]`` tensors (see
``lmplug.interfaces.kvcache.quantize_kv``); the ring and the rows address
them exactly as the data.

The baseline the paged cache is measured against: simple and fast to read
(a sequence's K/V is one contiguous slice), but every sequence holds memory
for the longest possible context.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from lmplug.api import (
    BackendOptions,
    Capabilities,
    KVCacheBackend,
    KVCacheSpec,
    KVLayerView,
    StatePool,
)
from lmplug.errors import ConfigError
from lmplug.kit import kv_extras


class ContiguousOptions(BackendOptions):
    max_num_seqs: int | None = Field(default=None, ge=1,
                                     description="rows to preallocate (default: the scheduler's max_num_seqs)")
    dtype: Literal["auto", "fp8_e4m3", "int8"] = Field(
        default="auto", description="K/V storage: auto = the model dtype; int8 / fp8_e4m3 = one byte per "
                                    "value plus a float32 scale per (token, KV head)")


class ContiguousKVCache(KVCacheBackend, kv_extras.Forks, kv_extras.CopyRecording, kv_extras.StateSlots):
    name = "contiguous"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), kv_layouts=frozenset({"contiguous"}),
                                features=frozenset({"sliding_window", "state", "fork_copy", "tp_copies"}),
                                priority=10)
    Options = ContiguousOptions

    @classmethod
    def kv_dtype_of(cls, options: ContiguousOptions) -> str:
        return options.dtype

    def __init__(self, options: ContiguousOptions, spec: KVCacheSpec) -> None:
        spec = spec.with_kv_dtype(options.dtype, self.name)
        super().__init__(options, spec)
        self.num_rows = options.max_num_seqs or spec.max_num_seqs
        self.row_slots = _row_slots(spec)
        _check_reservation(self.num_rows, self.row_slots, spec)
        # each layer at its own (KV heads, head_dim): models whose layers differ (Gemma 4)
        shapes = [(self.num_rows, self.row_slots, *spec.layer_shape(i)) for i in range(spec.num_layers)]

        def alloc(dtype: torch.dtype, drop_dim: bool = False) -> list[torch.Tensor]:
            # torch.empty: pages are only touched as sequences fill them
            return [torch.empty(shape[:3] if drop_dim else shape, dtype=dtype, device=spec.device)
                    for shape in shapes]

        self._k = alloc(spec.cache_dtype)
        # the latent layout (MLA) stores no V: attention gets an empty view
        self._v = [k[..., :0] for k in self._k] if spec.latent else alloc(spec.cache_dtype)
        # quantized: one float32 scale per (slot, KV head), same rows and slots as the data
        none = [None] * spec.num_layers
        self._k_scale = alloc(torch.float32, True) if spec.quantized else none
        self._v_scale = alloc(torch.float32, True) if spec.quantized else none
        self._views = [KVLayerView(k, v, "contiguous", ks, vs)
                       for k, v, ks, vs in zip(self._k, self._v, self._k_scale, self._v_scale)]
        self._free_rows = list(range(self.num_rows - 1, -1, -1))
        # state layers: a state slot per row's sequence, taken and released with the row
        self.states = StatePool(spec.states, self.num_rows, spec.device) if spec.states else None
        self._row_of: dict[int, int] = {}
        self._copies: list[tuple[int, int, int]] | None = None  # recorded for the other TP ranks

    @property
    def layout(self) -> str:
        return "contiguous"

    @property
    def block_size(self) -> int:
        return self.row_slots

    def layer_view(self, layer: int) -> KVLayerView:
        return self._views[layer]

    def can_allocate(self, seq, num_tokens: int) -> bool:
        if num_tokens > self.spec.max_model_len:
            return False
        return seq.seq_id in self._row_of or bool(self._free_rows)

    def allocate(self, seq, num_tokens: int) -> int:
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(f"contiguous KV cache: no room for sequence {seq.seq_id} "
                               f"({num_tokens} tokens; {len(self._free_rows)} free rows)")
        if seq.seq_id not in self._row_of:
            self._row_of[seq.seq_id] = self._free_rows.pop()
            if self.states is not None:
                self.states.take(seq.seq_id)
        return 0

    def free(self, seq) -> None:
        row = self._row_of.pop(seq.seq_id, None)
        if row is not None:
            self._free_rows.append(row)
        if self.states is not None:
            self.states.release(seq.seq_id)

    def fork(self, parent, child) -> None:
        """``child`` gets a row of its own holding a copy of ``parent``'s computed K/V (there are
        no shared blocks in this layout: a fork copies the row's first ``num_computed_tokens``
        slots, the whole ring once it wrapped). The feature is "fork_copy", not "fork": a fork
        needs a free row at once, so the engine uses it only where one was just freed (a beam
        group's dropped beam), never for n > 1 siblings."""
        if child.seq_id in self._row_of:
            raise RuntimeError(f"contiguous KV cache: fork into sequence {child.seq_id}, which holds a row")
        if not self._free_rows:
            raise RuntimeError(f"contiguous KV cache: no free row to fork sequence {parent.seq_id} into "
                               f"{child.seq_id} ({self.num_rows} rows)")
        if self.states is not None:
            raise RuntimeError("contiguous KV cache: fork with state layers is not supported")
        src = self._row_of[parent.seq_id]
        dst = self._row_of[child.seq_id] = self._free_rows.pop()
        self._copy_row(src, dst, min(parent.num_computed_tokens, self.row_slots))

    def record_copies(self) -> None:
        self._copies = []

    def take_copies(self) -> list[tuple[int, int, int]] | None:
        copies, self._copies = self._copies or None, None if self._copies is None else []
        return copies

    def apply_copies(self, copies: list[tuple[int, int, int]]) -> None:
        for src, dst, used in copies:
            self._copy_row(src, dst, used)

    def _copy_row(self, src: int, dst: int, used: int) -> None:
        """Row ``dst``'s first ``used`` slots (and scales) := row ``src``'s."""
        if self._copies is not None:
            self._copies.append((src, dst, used))
        tensors = self._k + ([] if self.spec.latent else self._v)
        if self.spec.quantized:
            tensors += self._k_scale + self._v_scale
        for t in tensors:
            t[dst, :used] = t[src, :used]

    def block_table(self, seq) -> list[int]:
        # the ring's row repeats for every `row_slots` positions (once when there is no ring)
        return [self._row_of[seq.seq_id]] * -(-self.spec.max_model_len // self.row_slots)

    @property
    def usage(self) -> float:
        return len(self._row_of) / self.num_rows


def _check_reservation(rows: int, slots: int, spec: KVCacheSpec) -> None:
    """The rows are reserved up front (address space on a CPU, memory on a GPU): more than the
    machine has available is a start-up error, not an out-of-memory crash mid-run."""
    need = rows * (slots * spec.bytes_per_token + spec.state_bytes_per_seq)
    available, where = _available(spec.device)
    if available is None or need <= available:
        return
    raise ConfigError(f"kvcache: contiguous: max_num_seqs={rows} rows x {slots} slots (max_model_len="
                      f"{spec.max_model_len}) x {spec.bytes_per_token} bytes/token = {need} bytes "
                      f"({need / 2**30:.2f} GiB), more than the {available} bytes ({available / 2**30:.2f} "
                      f"GiB) {where}; lower max_num_seqs or max_model_len, or use `kvcache: paged`")


def _available(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, "free on the GPU"
    from lmplug_kvcache.paged import _mem_available
    try:
        return _mem_available(), "available (MemAvailable)"
    except ConfigError:
        return None, ""


def _row_slots(spec: KVCacheSpec) -> int:
    """Slots per row: the whole context, or a ring when a sliding window allows one."""
    if spec.sliding_window is None or spec.max_num_batched_tokens is None:
        return spec.max_model_len
    return min(spec.max_model_len, spec.sliding_window + spec.max_num_batched_tokens - 1)
