"""The reference LoRA backend: the step's tokens grouped by slot, two small matmuls per group.

Decode batches over many adapters gather each token's A and B and run two batched products;
other steps (prefill chunks, a few adapters) take one shrink and one expand per slot over its
tokens. Any device torch runs on; rows without an adapter are never touched. On the CPU it also
hands the native decode step a C product per adapted layer (``lora_native``).
"""

from __future__ import annotations

import torch

from lmplug.api import AdapterBackend, Capabilities
from lmplug.kit.extras import NativeLoRA

# a step of at most GATHER_TOKENS tokens over more than GROUPED_SLOTS adapters gathers each token's
# own A and B (one bmm each); otherwise one shrink and one expand per adapter over its tokens
GATHER_TOKENS = 16
GROUPED_SLOTS = 4


class TorchLoRA(AdapterBackend, NativeLoRA):
    name = "torch"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), priority=10)

    def native_lora(self, base, lora):
        """The native decode step's product of an adapted layer (``lora_native``: C, float32 CPU)."""
        from lmplug_adapter import lora_native

        return lora_native.wrap(base, lora)

    def prepare(self, token_slots: torch.Tensor, token_slots_cpu: list[int]) -> object:
        groups: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots_cpu):
            if s >= 0:
                groups.setdefault(s, []).append(t)
        if len(token_slots_cpu) <= GATHER_TOKENS and len(groups) > GROUPED_SLOTS:
            rows = [t for t, s in enumerate(token_slots_cpu) if s >= 0]
            index = torch.tensor(rows, dtype=torch.long, device=token_slots.device)
            return "gather", index, token_slots[index].long()
        out = []
        for s, rows in groups.items():
            # a contiguous run is a slice (a view: no gather, no scatter)
            where = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else \
                torch.tensor(rows, dtype=torch.long, device=token_slots.device)
            out.append((s, where))
        return "grouped", out

    def apply(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: object) -> None:
        if meta[0] == "gather":
            _, rows, slots = meta
            xs = x[rows].unsqueeze(-1)  # [n, in, 1]
            mid = torch.bmm(a[slots], xs)  # [n, KR, 1]
            y.index_add_(0, rows, torch.bmm(b[slots], mid).squeeze(-1))
            return
        for s, where in meta[1]:
            delta = (x[where] @ a[s].T) @ b[s].T
            if isinstance(where, slice):
                y[where] += delta
            else:
                y.index_add_(0, where, delta)
