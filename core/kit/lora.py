"""LoRA slots inside the linear layers (the storage the ``adapter`` family's backends read).

``attach(model, backend, ...)`` gives every attention and MLP ``Linear`` a ``LinearLoRA``: its
stacked A and B slots (layout: ``lmplug.interfaces.adapter``) and the model's one ``LoRAStep``,
which the runner sets once per step (each token's slot) and every layer reads. The slots are
plain tensors, not parameters: the checkpoint loader and the memory report never see them.

Under tensor parallelism each rank's slots hold its part of every adapter, sharded as the base
weight: a column-parallel layer (q/k/v, gate/up) keeps A whole and the rows of B of its output
features; a row-parallel layer (o, down) keeps the columns of A of its input features and B
whole, so its partial update ``x_r A_r^T B^T`` is summed by the layer's own all-reduce with the
base product's partials (no collective of its own).
"""

from __future__ import annotations

import ctypes

import torch

from lmplug.interfaces.adapter import AdapterBackend
from lmplug.kit import extras
from lmplug.kit.layers import Linear
from lmplug.kit.native import NativeCall
from lmplug.kit.packed_embedding import QuantEmbedding


class NativeRows(ctypes.Structure):
    """This step's row -> slot map as the native decode step's LoRA products read it (C:
    ``struct { int64_t n; const int32_t *slots; }``; n = 0: no row has an adapter)."""

    _fields_ = [("n", ctypes.c_int64), ("slots", ctypes.c_void_p)]


class LoRAStep:
    """This step's per-token slots as the backend prepared them; None: no row has an adapter."""

    def __init__(self, backend: AdapterBackend) -> None:
        self.backend = backend
        self.meta: object | None = None
        self.native_rows = NativeRows(0, None)
        self._native_slots: torch.Tensor | None = None  # what ``native_rows`` points into

    def set(self, token_slots_cpu: list[int] | None, device: torch.device) -> None:
        if not token_slots_cpu or max(token_slots_cpu) < 0:
            self.meta = None
            self.native_rows.n, self.native_rows.slots, self._native_slots = 0, None, None
            return
        slots = torch.tensor(token_slots_cpu, dtype=torch.int32, device=device)
        if slots.is_cpu:
            self._native_slots = slots
            self.native_rows.n, self.native_rows.slots = slots.numel(), slots.data_ptr()
        self.meta = self.backend.prepare(slots, token_slots_cpu)


class LinearLoRA:
    """One ``Linear``'s slots: ``prefixes[k]`` is shard k's checkpoint module name (what a PEFT
    adapter's keys name), ``ranges[k]`` its output columns; ``out_starts[k]`` the first of them in
    the checkpoint's shard and ``in_start`` the first input feature (nonzero under tensor
    parallelism); ``full_in`` / ``full_out[k]``: the checkpoint's sizes (what an adapter must fit)."""

    def __init__(self, linear: Linear, prefixes: list[str], step: LoRAStep, num_slots: int,
                 max_rank: int) -> None:
        self.step = step
        self.prefixes = prefixes
        self.ranges = [linear.shard_range(shard) for shard in linear.shards]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        starts = getattr(linear, "tp_starts", None)  # a column-parallel layer's (``ColumnShard``)
        self.out_starts = [starts[shard] if starts else 0 for shard in linear.shards]
        self.in_start, self.full_in = linear.input_start, linear.full_in_features
        self.full_out = [start + end - begin for start, (begin, end) in zip(self.out_starts, self.ranges)]
        self.max_rank = max_rank
        k = len(prefixes)
        device = next(iter(linear.buffers()), next(iter(linear.parameters()), torch.empty(0))).device
        self.a = torch.zeros(num_slots, k * max_rank, linear.in_features, dtype=linear.dtype, device=device)
        self.b = torch.zeros(num_slots, linear.out_features, k * max_rank, dtype=linear.dtype, device=device)
        # each output row's own shard's R columns of b ([S, out, R]), kept only once a native product
        # asks for it (``compact_b``): what the native step's expand reads, none of b's zeros
        self.b_compact: torch.Tensor | None = None

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = self.step.meta
        if meta is None:
            return y
        flat = y.reshape(-1, y.shape[-1])
        self.step.backend.apply(flat, x.reshape(-1, x.shape[-1]), self.a, self.b, meta)
        return flat.view(y.shape)

    def compact_b(self) -> torch.Tensor:
        """``b`` without the block-diagonal zeros: row o holds its shard's R columns ([S, out, R]),
        kept in step with every later ``fill``."""
        if self.b_compact is None:
            self.b_compact = torch.empty(self.b.shape[0], self.out_features, self.max_rank, dtype=self.b.dtype,
                                         device=self.b.device)
            for k, (start, end) in enumerate(self.ranges):
                self.b_compact[:, start:end] = self.b[:, start:end, k * self.max_rank:(k + 1) * self.max_rank]
        return self.b_compact

    def native_product(self, base: NativeCall) -> NativeCall | None:
        """``base`` (the layer's native product) with this layer's LoRA update added, from the
        adapter backend (``extras.NativeLoRA``), or None: the native decode step is off."""
        return extras.native_lora(self.step.backend, base, self)

    def fill(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these shards' (A [r, full_in], B [full_out_k, r], scaling folded
        into B; this rank's part of them); the shards not given (and the rank's padding) hold zeros."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for k, (a, b) in shards.items():
            r, (start, end), first = a.shape[0], self.ranges[k], self.out_starts[k]
            self.a[slot, k * self.max_rank:k * self.max_rank + r].copy_(
                a[:, self.in_start:self.in_start + self.in_features])
            self.b[slot, start:end, k * self.max_rank:k * self.max_rank + r].copy_(b[first:first + end - start])
        if self.b_compact is not None:
            for k, (start, end) in enumerate(self.ranges):
                self.b_compact[slot, start:end] = self.b[slot, start:end, k * self.max_rank:(k + 1) * self.max_rank]


def attach(model: torch.nn.Module, backend: AdapterBackend, num_slots: int, max_rank: int) -> dict[str, LinearLoRA]:
    """Slots on every ``Linear`` of the decoder layers (not the LM head nor a packed embedding); returns them by the
    checkpoint module name of each shard (``model.layers.0.self_attn.q_proj``). Under tensor
    parallelism every rank calls it (the ranks agree on each shard's full output size)."""
    step = LoRAStep(backend)
    describe = getattr(model, "checkpoint_name", None)
    by_prefix: dict[str, LinearLoRA] = {}
    for path, module in model.named_modules():
        if not isinstance(module, Linear) or "lm_head" in module.shards or isinstance(module, QuantEmbedding):
            continue  # the LM head and a packed embedding (a tied model's LM head too) keep no slots
        prefixes = [describe(f"{path}.weight", shard).rpartition(".")[0] if describe else path
                    for shard in module.shards]
        lora = LinearLoRA(module, prefixes, step, num_slots, max_rank)
        module.lora = lora
        for prefix in prefixes:
            by_prefix[prefix] = lora
    tp = getattr(model, "tp", None)
    if tp is not None and tp.is_parallel:
        _full_out_sizes(tp, by_prefix)
    model.lora_step = step
    return by_prefix


def _full_out_sizes(tp, by_prefix: dict[str, LinearLoRA]) -> None:
    """Each column shard's checkpoint output size: the largest end of a rank's rows (a KV head
    replicated over ranks ends where another's does)."""
    layers = list(dict.fromkeys(by_prefix.values()))
    gathered = tp.all_gather_object([lin.full_out for lin in layers])
    for i, lin in enumerate(layers):
        lin.full_out = [max(rank[i][k] for rank in gathered) for k in range(len(lin.full_out))]
