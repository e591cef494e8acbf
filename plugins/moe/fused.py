"""``fused``: MoE experts as Triton grouped GEMMs over tokens sorted by expert.

Routing is the shared PyTorch code (``routing.py``); the experts run in two
kernel launches whatever the number of experts (``fused_kernels.py``), with
the gate/up SiLU-and-multiply fused into the first. The PyTorch twin is the
``reference`` backend.

Runs on CUDA. Under ``TRITON_INTERPRET=1`` (tests, the conformance suite) it
also claims the CPU, with a priority below ``reference`` so that
``backend: auto`` never picks interpreted kernels; name it to use it there.

It reads stacked dense experts only: a quantized model's experts reach it
dequantized (the default for experts, on CPU and CUDA); experts kept packed
(``dequantize_at_load: false``) are refused at load in favour of ``reference``.
"""

from __future__ import annotations

import os

import torch
from lmplug_moe.routing import select_experts
from pydantic import Field, field_validator

from lmplug.api import BackendOptions, Capabilities, MoEBackend, RoutingConfig

# read once, as triton does when it is first imported
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class FusedMoEOptions(BackendOptions):
    block_m: int | None = Field(
        default=None, description="rows (token-expert pairs) per tile, a power of two >= 16; "
                                  "None: chosen from the tokens per expert")

    @field_validator("block_m")
    @classmethod
    def _power_of_two(cls, value: int | None) -> int | None:
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError("must be a power of two >= 16")
        return value


class FusedMoE(MoEBackend):
    name = "fused"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"} if _INTERPRETED else {"cuda"}),
        priority=1 if _INTERPRETED else 30,  # above reference (10) on CUDA
    )
    Options = FusedMoEOptions

    def __init__(self, options: FusedMoEOptions) -> None:
        super().__init__(options)
        from lmplug_moe.fused_kernels import fused_experts  # triton loads with the backend

        self._fused_experts = fused_experts

    def route(self, router_logits: torch.Tensor, routing: RoutingConfig | int, renormalize: bool = True, *,
              correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(router_logits, RoutingConfig.of(routing, renormalize), correction_bias)

    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return self._fused_experts(x, expert_ids, weights, w_gate_up, w_down, block_m=self.options.block_m)
