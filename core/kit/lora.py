"""LoRA slots inside the linear layers (the storage the ``adapter`` family's backends read).

``attach(model, backend, ...)`` gives every attention and MLP ``Linear`` a ``LinearLoRA``: its
stacked A and B slots (layout: ``lmplug.interfaces.adapter``) and the model's one ``LoRAStep``,
which the runner sets once per step (each token's slot) and every layer reads; a float32 CPU
layer also keeps ``NativeSlots`` (what the native decode step's C product reads: 16-bit adapters
in their own dtype). The slots are
plain tensors, not parameters: the checkpoint loader and the memory report never see them.

Under tensor parallelism each rank's slots hold its part of every adapter, sharded as the base
weight: a column-parallel layer (q/k/v, gate/up) keeps A whole and the rows of B of its output
features; a row-parallel layer (o, down) keeps the columns of A of its input features and B
whole, so its partial update ``x_r A_r^T B^T`` is summed by the layer's own all-reduce with the
base product's partials (no collective of its own).
"""

from __future__ import annotations

import ctypes
import math

import torch

from lmplug.interfaces.adapter import AdapterBackend
from lmplug.kit import extras, hugemem
from lmplug.kit.layers import Linear
from lmplug.kit.native import NativeCall
from lmplug.kit.packed_embedding import QuantEmbedding


def _streamed_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in huge-page memory (``lmplug.kit.hugemem``): the native product streams the slots of
    every adapted row each step, as the GGUF kernels stream their weights."""
    return hugemem.empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape).zero_()


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


class NativeSlots:
    """A float32 CPU layer's slots as the native product reads them (``lmplug_adapter.lora_native``):
    per slot its dtype (``DTYPES``' index) and its shards' scalings; a 16-bit slot's A in ``a16``
    and its unscaled B (in the file's dtype, so nothing is rounded) in the first half of its
    ``b`` slot; a float32 slot's A is the layer's ``a`` and its ``b`` the scaled float32 B. ``b``
    is compact ([S, out, R]: each output row's own shard's R columns, none of the block-diagonal
    zeros). Every slot has room for float32, so adapters of any dtype share the slots and the
    addresses never change. A and B are in huge pages (``_streamed_zeros``)."""

    DTYPES = (torch.float32, torch.float16, torch.bfloat16)

    def __init__(self, num_slots: int, shards: int, rank: int, d_in: int, d_out: int) -> None:
        self.rank = rank
        self.dtype = torch.zeros(num_slots, dtype=torch.int32)
        self.scale = torch.ones(num_slots, shards, dtype=torch.float32)
        self.a16 = _streamed_zeros((num_slots, shards * rank, d_in), torch.int16)
        self.b = _streamed_zeros((num_slots, d_out, rank), torch.float32)

    def fill(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor, float]], lora: LinearLoRA) -> None:
        dtypes = {t.dtype for a, b, _ in shards.values() for t in (a, b)}
        dtype = dtypes.pop() if len(dtypes) == 1 and dtypes <= set(self.DTYPES[1:]) else torch.float32
        self.dtype[slot] = self.DTYPES.index(dtype)
        self.scale[slot] = 1.0
        self.b[slot].zero_()
        if dtype == torch.float32:
            for k, (start, end) in enumerate(lora.ranges):
                self.b[slot, start:end] = lora.b[slot, start:end, k * self.rank:(k + 1) * self.rank]
            return
        self.a16[slot].zero_()
        a16, b16 = self.a16[slot].view(dtype), self.b[slot].view(-1).view(dtype)[:self.b[slot].numel()]
        b16 = b16.view(self.b.shape[1], self.rank)
        for k, (a, b, scale) in shards.items():
            (start, end), r = lora.ranges[k], a.shape[0]
            a16[k * self.rank:k * self.rank + r].copy_(a)
            b16[start:end, :r].copy_(b)
            self.scale[slot, k] = scale


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
        native = device.type == "cpu" and linear.dtype == torch.float32
        a_shape = (num_slots, k * max_rank, linear.in_features)  # the native product reads a float32 slot's A here
        self.a = _streamed_zeros(a_shape, linear.dtype) if native else torch.zeros(a_shape, dtype=linear.dtype,
                                                                                   device=device)
        self.b = torch.zeros(num_slots, linear.out_features, k * max_rank, dtype=linear.dtype, device=device)
        # what the native decode step reads (float32 CPU layers only: NativeSlots)
        self.native = NativeSlots(num_slots, k, max_rank, self.in_features, self.out_features) if native else None

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = self.step.meta
        if meta is None:
            return y
        flat = y.reshape(-1, y.shape[-1])
        self.step.backend.apply(flat, x.reshape(-1, x.shape[-1]), self.a, self.b, meta)
        return flat.view(y.shape)

    def native_product(self, base: NativeCall) -> NativeCall | None:
        """``base`` (the layer's native product) with this layer's LoRA update added, from the
        adapter backend (``extras.NativeLoRA``), or None: the native decode step is off."""
        return extras.native_lora(self.step.backend, base, self)

    def fill(self, slot: int, shards: dict[int, tuple]) -> None:
        """Slot ``slot`` holds these shards' (A [r, full_in], B [full_out_k, r], and the scaling:
        1 when not given; this rank's part of them); the shards not given (and the rank's padding)
        hold zeros. ``a`` / ``b`` get float32 (or the layer's dtype) with the scaling folded into B;
        the native slots keep the given dtype where all of A and B are one 16-bit dtype."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        cut = {}
        for k, (a, b, *scale) in shards.items():
            r, (start, end), first = a.shape[0], self.ranges[k], self.out_starts[k]
            a, b = a[:, self.in_start:self.in_start + self.in_features], b[first:first + end - start]
            cut[k] = (a, b, scale[0] if scale else 1.0)
            self.a[slot, k * self.max_rank:k * self.max_rank + r].copy_(a)
            self.b[slot, start:end, k * self.max_rank:k * self.max_rank + r].copy_(b.float() * cut[k][2])
        if self.native is not None:
            self.native.fill(slot, cut, self)


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
