"""LoRA adapters: the ``adapter`` family (a batch's rows, each with its own low-rank update).

Many fine-tunes of one base model are served at once: the base weights stay as they are (dense,
GGUF blocks, GPTQ / AWQ / fp8: whatever the ``Linear``'s quant method holds) and each adapted
linear layer adds ``B_s (A_s x)`` for the adapter ``s`` of the row. The core owns the storage
(``lmplug.kit.lora``): every adapted ``Linear`` holds ``max_loras`` slots

    a [S, K * R, in]     the shards' A matrices one after another (a fused q/k/v layer: K = 3)
    b [S, out, K * R]    their B matrices block-diagonal, each shard's rows its output columns

with R = ``max_lora_rank``: a rank below R is padded with zeros, and the adapter's scaling
(``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA) is folded into B when a slot is filled. So
one shrink ``x @ a[s].T`` and one expand ``@ b[s].T`` serve every shard of the layer.

A backend is the math of one step over those slots: ``prepare`` reads each token's slot once per
step (``token_slots`` [T] int32, -1: no adapter) into whatever its kernels want (segments of
tokens sharing a slot, as Punica's SGMV does), and ``apply`` adds the update into the base
output ``y`` for every layer. Rows without an adapter must come back bit-identical.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import Field

from lmplug.interfaces.common import BackendOptions, Capabilities


class AdapterOptions(BackendOptions):
    """The ``lora:`` section: how many adapters, how large, how many host copies."""

    max_loras: int = Field(default=4, ge=1, le=256, description="adapters resident on the device at once "
                           "(slots); a step with requests for more runs its rows in groups of this many")
    max_lora_rank: int = Field(default=16, ge=1, le=1024, description="the largest rank an adapter may "
                               "have (slots are this wide; a larger one is refused when it loads)")
    max_cpu_loras: int | None = Field(default=None, ge=1, le=4096, description="adapters whose weights "
                                      "stay in host memory (least recently used dropped, read again from "
                                      "their folder when asked for); default: 4 x max_loras")

    @property
    def host_copies(self) -> int:
        return max(self.max_cpu_loras or 4 * self.max_loras, self.max_loras)


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's ``LoRARequest``): its name (what ``model:`` names
    in the server), a positive integer id, and its PEFT folder (``adapter_config.json`` +
    ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        from lmplug.errors import ConfigError

        if not isinstance(self.lora_name, str) or not self.lora_name or len(self.lora_name) > 256:
            raise ConfigError(f"LoRARequest: lora_name must be a non-empty string of at most 256 "
                              f"characters, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ConfigError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1, "
                              f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ConfigError(f"LoRARequest {self.lora_name!r}: lora_path must be the adapter's folder, "
                              f"got {self.lora_path!r}")


class AdapterBackend(ABC):
    """The per-step math of the LoRA slots (storage: the module docstring)."""

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    Options: ClassVar[type[AdapterOptions]] = AdapterOptions

    def __init__(self, options: AdapterOptions) -> None:
        self.options = options

    def prepare(self, token_slots: torch.Tensor, token_slots_cpu: list[int]) -> object:
        """Once per step: each token's slot ([T] int32 on the device, and its host copy; -1:
        none) into what ``apply`` reads in every layer. Default: the two as they are."""
        return token_slots, token_slots_cpu

    @abstractmethod
    def apply(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              meta: object) -> None:
        """``y[t] += b[s] @ (a[s] @ x[t])`` for every token t whose slot s = token_slots[t] >= 0,
        in place. ``x`` [T, in], ``y`` [T, out] (the base layer's output, the layer's own),
        ``a`` [S, K * R, in], ``b`` [S, out, K * R]; ``meta``: what ``prepare`` returned."""
