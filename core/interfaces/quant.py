"""Quantization methods: create, load, post-process and apply a linear layer's weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities


class QuantMethod(ABC):
    """One object per engine; it decides per linear layer and owns that layer's math.

    ``create_weights`` registers parameters on ``layer`` (a ``torch.nn.Module``),
    the loader copies checkpoint tensors into them by name,
    ``process_weights_after_loading`` repacks once, and ``apply`` computes
    ``y = x W^T (+ b)``. The same object can quantize offline.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @classmethod
    def from_checkpoint_config(cls, quantization_config: dict) -> BackendOptions:
        """Options from a checkpoint's ``quantization_config``."""
        return cls.Options(**{k: v for k, v in quantization_config.items() if k in cls.Options.model_fields})

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype, bias: bool) -> None: ...

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded tensors once (default: nothing to do)."""
