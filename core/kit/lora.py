"""LoRA slots inside the linear layers (the storage the ``adapter`` family's backends read).

``attach(model, backend, ...)`` gives every attention and MLP ``Linear`` a ``LinearLoRA``: its
stacked A and B slots (layout: ``lmplug.interfaces.adapter``) and the model's one ``LoRAStep``,
which the runner sets once per step (each token's slot) and every layer reads. The slots are
plain tensors, not parameters: the checkpoint loader and the memory report never see them.
"""

from __future__ import annotations

import torch

from lmplug.interfaces.adapter import AdapterBackend
from lmplug.kit.layers import Linear


class LoRAStep:
    """This step's per-token slots as the backend prepared them; None: no row has an adapter."""

    def __init__(self, backend: AdapterBackend) -> None:
        self.backend = backend
        self.meta: object | None = None

    def set(self, token_slots_cpu: list[int] | None, device: torch.device) -> None:
        if not token_slots_cpu or max(token_slots_cpu) < 0:
            self.meta = None
            return
        slots = torch.tensor(token_slots_cpu, dtype=torch.int32, device=device)
        self.meta = self.backend.prepare(slots, token_slots_cpu)


class LinearLoRA:
    """One ``Linear``'s slots: ``prefixes[k]`` is shard k's checkpoint module name (what a PEFT
    adapter's keys name), ``ranges[k]`` its output columns."""

    def __init__(self, linear: Linear, prefixes: list[str], step: LoRAStep, num_slots: int,
                 max_rank: int) -> None:
        self.step = step
        self.prefixes = prefixes
        self.ranges = [linear.shard_range(shard) for shard in linear.shards]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.max_rank = max_rank
        k = len(prefixes)
        device = next(iter(linear.buffers()), next(iter(linear.parameters()), torch.empty(0))).device
        self.a = torch.zeros(num_slots, k * max_rank, linear.in_features, dtype=linear.dtype, device=device)
        self.b = torch.zeros(num_slots, linear.out_features, k * max_rank, dtype=linear.dtype, device=device)

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        meta = self.step.meta
        if meta is None:
            return y
        flat = y.reshape(-1, y.shape[-1])
        self.step.backend.apply(flat, x.reshape(-1, x.shape[-1]), self.a, self.b, meta)
        return flat.view(y.shape)

    def fill(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these shards' (A [r, in], B [out_k, r], scaling folded into B);
        the shards not given (and the rank's padding) hold zeros."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for k, (a, b) in shards.items():
            r, (start, end) = a.shape[0], self.ranges[k]
            self.a[slot, k * self.max_rank:k * self.max_rank + r].copy_(a)
            self.b[slot, start:end, k * self.max_rank:k * self.max_rank + r].copy_(b)


def attach(model: torch.nn.Module, backend: AdapterBackend, num_slots: int, max_rank: int) -> dict[str, LinearLoRA]:
    """Slots on every ``Linear`` of the decoder layers (not the LM head); returns them by the
    checkpoint module name of each shard (``model.layers.0.self_attn.q_proj``)."""
    step = LoRAStep(backend)
    describe = getattr(model, "checkpoint_name", None)
    by_prefix: dict[str, LinearLoRA] = {}
    for path, module in model.named_modules():
        if not isinstance(module, Linear) or "lm_head" in module.shards:
            continue
        prefixes = [describe(f"{path}.weight", shard).rpartition(".")[0] if describe else path
                    for shard in module.shards]
        lora = LinearLoRA(module, prefixes, step, num_slots, max_rank)
        module.lora = lora
        for prefix in prefixes:
            by_prefix[prefix] = lora
    model.lora_step = step
    return by_prefix
