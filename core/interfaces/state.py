"""Per-sequence state of linear-attention and state-space layers: fixed-size slots beside the KV.

A softmax-attention layer stores K/V that grow with the sequence; a linear or SSM layer (Mamba2's
SSD, lightning attention, the gated delta rule) carries a state whose size does not depend on the
context: a recurrent state (e.g. ``[heads, head_dim, state_dim]`` in fp32) and, for layers with a
causal convolution, the last ``kernel - 1`` inputs of that convolution. The model declares what
each of its state layers needs (``StateSpec``, one per state layer, in ``KVCacheSpec.states``);
nothing in the engine names a state kind.

``StatePool`` is the one storage every KV backend with the ``"state"`` feature composes: each
state tensor is a pool ``[num_slots, *shape]``; a sequence holds one slot index, the same in
every layer, from its first ``allocate`` until ``free``. A slot is zeroed when taken (a fresh
sequence starts from the zero state, which is what a prefill with no history computes), copied
on ``fork``, and returned on ``free`` (a preempted sequence is recomputed from a fresh slot).
The kernels (``lmplug.interfaces.mixer``) read and write the pool rows in place through the
step's ``StepContext.state_slots``.

The state cannot be rolled back a few tokens (it is a running sum, not a list of per-token
entries), so speculative decoding, whose rejected drafts must leave no trace, is refused at
load for models with state layers, and so is prefix caching (a block of K/V can be shared; a
state after a prefix would need snapshots at block boundaries, which are not built).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# ``ModelConfig.layer_types`` entries: softmax attention layers (K/V in the cache) ...
ATTENTION = "attention"
# ... and the state layers each first-party architecture has (any other name is a state layer too)
MAMBA2 = "mamba2"
LIGHTNING = "linear_attention"
GATED_DELTA = "gated_delta"


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a layer's per-sequence state: ``shape`` per sequence (no slot dim)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """What one state layer keeps per sequence. ``layer``: the model layer (for messages);
    ``kind``: the layer type (``ModelConfig.layer_types``)."""

    layer: int
    kind: str
    tensors: tuple[StateTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def state_bytes(states: Iterable[StateSpec]) -> int:
    """Bytes one sequence's state takes over every state layer."""
    return sum(s.nbytes for s in states)


def cache_indices(layer_types: Sequence[str]) -> list[int]:
    """Each model layer's index in its own store: attention layers count K/V layers (0, 1, ...),
    state layers count state layers, in model order."""
    counts: dict[bool, int] = {True: 0, False: 0}
    out = []
    for kind in layer_types:
        is_attention = kind == ATTENTION
        out.append(counts[is_attention])
        counts[is_attention] += 1
    return out


class StatePool:
    """``num_slots`` slots of every state layer's tensors, and which sequence holds which slot.

    Owned by a KV backend; the scheduler sees it through the backend's ``can_allocate`` (a new
    sequence needs a free slot) and the engine through ``state_slot``.
    """

    def __init__(self, specs: Sequence[StateSpec], num_slots: int, device: torch.device) -> None:
        self.specs = tuple(specs)
        self.num_slots = num_slots
        # layer -> name -> [num_slots, *shape]; zeros, so an untouched slot holds the zero state
        self.tensors: list[dict[str, torch.Tensor]] = [
            {t.name: torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=device) for t in spec.tensors}
            for spec in self.specs]
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return self.num_slots * state_bytes(self.specs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._slot_of

    def can_take(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds a slot or one is free for it."""
        return seq_id in self._slot_of or bool(self._free)

    def take(self, seq_id: int) -> int:
        """The slot of ``seq_id``, taking (and zeroing) a free one on first call."""
        slot = self._slot_of.get(seq_id)
        if slot is not None:
            return slot
        if not self._free:
            raise RuntimeError(f"state pool: no free slot for sequence {seq_id} "
                               f"({self.num_slots} slots, all held)")
        slot = self._free.pop()
        for layer in self.tensors:
            for t in layer.values():
                t[slot].zero_()
        self._slot_of[seq_id] = slot
        return slot

    def release(self, seq_id: int) -> None:
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def copy(self, src_id: int, dst_id: int) -> None:
        """Give ``dst_id`` a slot holding a copy of ``src_id``'s state (``n > 1`` forks)."""
        src = self._slot_of[src_id]
        dst = self.take(dst_id)
        for layer in self.tensors:
            for t in layer.values():
                t[dst].copy_(t[src])

    def snapshot(self, seq_id: int) -> list[dict[str, torch.Tensor]]:
        """Copies of ``seq_id``'s state (every layer), e.g. to swap it out of the pool."""
        slot = self.slot(seq_id)
        return [{name: t[slot].clone() for name, t in layer.items()} for layer in self.tensors]

    def restore(self, seq_id: int, snapshot: list[dict[str, torch.Tensor]]) -> None:
        """Take a slot for ``seq_id`` and fill it from ``snapshot``."""
        slot = self.take(seq_id)
        for layer, saved in zip(self.tensors, snapshot, strict=True):
            for name, t in layer.items():
                t[slot].copy_(saved[name])

    def slot(self, seq_id: int) -> int:
        slot = self._slot_of.get(seq_id)
        if slot is None:
            raise KeyError(f"state pool: sequence {seq_id} holds no slot (allocate it first)")
        return slot

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """State layer ``index``'s pools, by tensor name."""
        return self.tensors[index]
