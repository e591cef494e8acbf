"""MoE backends: a router (logits -> experts, weights) and an expert executor."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities


class MoEBackend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @abstractmethod
    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (expert ids [T, k], weights [T, k])."""

    @abstractmethod
    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """x [T, h]; w_gate_up [E, 2I, h]; w_down [E, h, I] -> [T, h], weighted and summed."""
