"""``SwapSpace``: where the paged cache keeps preempted sequences' K/V instead of dropping them.

With ``scheduler: {preemption: swap}``, a preempted sequence's computed blocks (every layer's
K/V and scales) and its state slot are copied out of the pool (to host memory: on a GPU the
slower, larger tier; on a CPU a copy that saves the recomputation), its blocks are released, and
it waits with its computed tokens kept. When it is admitted again it gets blocks, the copies go
back, and it continues where it stopped: the same K/V, so the same output. ``swap_space_gb``
bounds the copies; a sequence that does not fit is preempted by recomputation instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Swapped:
    num_tokens: int  # the computed tokens the copies hold
    kv: torch.Tensor  # [L, 1|2, blocks, bs, Hkv, D]
    scales: torch.Tensor | None  # [L, 1|2, blocks, bs, Hkv] or None
    state: list[dict[str, torch.Tensor]] | None  # the state slot (``StatePool.snapshot``)

    @property
    def nbytes(self) -> int:
        tensors = [self.kv] + ([self.scales] if self.scales is not None else [])
        tensors += [t for layer in self.state or [] for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class SwapSpace:
    def __init__(self, limit_bytes: int, device: torch.device) -> None:
        self.limit = limit_bytes
        # host memory on a GPU (pinned, so the copies back are fast); the pool's own memory on a CPU
        self.pin = device.type == "cuda"
        self._held: dict[int, Swapped] = {}
        self.used = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._held

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = t.to("cpu", copy=True)
        return host.pin_memory() if self.pin else host

    def store(self, seq_id: int, swapped: Swapped) -> None:
        self._held[seq_id] = swapped
        self.used += swapped.nbytes
        self.num_swapped_out += 1

    def take(self, seq_id: int) -> Swapped:
        swapped = self._held.pop(seq_id)
        self.used -= swapped.nbytes
        self.num_swapped_in += 1
        return swapped

    def drop(self, seq_id: int) -> None:
        swapped = self._held.pop(seq_id, None)
        if swapped is not None:
            self.used -= swapped.nbytes
