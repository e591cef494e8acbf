"""Attention backends: compute attention for one layer over the step's tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.step import StepContext


class AttentionBackend(ABC):
    """One object per engine, shared by all layers.

    ``forward`` writes the new K/V of this step into the cache (at
    ``ctx.slot_mapping``) and returns attention over the whole context of each
    sequence: everything cached before this step plus the new tokens, causal.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, sliding_window: int | None = None) -> None:
        self.options = options
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: "KVLayerView", ctx: StepContext) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (the step's new tokens). Returns [T, H, D]."""


class KVLayerView:
    """One layer's K and V storage, as the KV backend hands it to attention.

    ``k_cache`` / ``v_cache``: [num_blocks, block_size, Hkv, D]. Slot ``s`` is
    block ``s // block_size``, offset ``s % block_size``; a sequence's blocks
    are listed in ``StepContext.block_tables``. The contiguous layout is the
    special case of one block of ``max_model_len`` slots per sequence.
    """

    __slots__ = ("k_cache", "v_cache", "layout")

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> None:
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.layout = layout

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]
