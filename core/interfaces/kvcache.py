"""KV storage: owns the cache tensors (storage side) and counts slots (accounting side)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from lmplug.interfaces.attention import KVLayerView
from lmplug.interfaces.common import BackendOptions, Capabilities

if TYPE_CHECKING:
    from lmplug.engine.sequence import Sequence


@dataclass(frozen=True)
class KVCacheSpec:
    """What the model needs stored per token and layer, and the engine's limits."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    # attention sees only the last `sliding_window` keys; backends listing the
    # "sliding_window" feature release what falls out of it
    sliding_window: int | None = None
    # the most new tokens one step writes per sequence (the scheduler's token budget)
    max_num_batched_tokens: int | None = None
    # MLA: one "K" row per token and layer (num_kv_heads=1, head_dim = kv_lora_rank + rope dims)
    # holds the latent and the shared RoPE key; there is no V, and backends allocate none
    latent: bool = False

    @property
    def num_kv_tensors(self) -> int:
        """Tensors stored per layer: K and V, or the latent alone."""
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V (or latent): tensors x layers x kv_heads x head_dim x dtype bytes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_tensors * self.num_layers * self.num_kv_heads * self.head_dim * elem


class KVCacheBackend(ABC):
    """The scheduler talks to the accounting methods; attention reads ``layer_view``.

    The scheduler never touches tensors; the runner asks ``block_table(seq)``
    to build slot mappings. Slots of a sequence are ``block_table[i] *
    block_size + offset``.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions, spec: KVCacheSpec) -> None:
        self.options = options
        self.spec = spec

    # -- layout ---------------------------------------------------------------
    @property
    @abstractmethod
    def layout(self) -> str:
        """The layout attention must read: "contiguous", "paged" or "latent"."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Slots per block (for contiguous: ``max_model_len``, one block per sequence)."""

    @abstractmethod
    def layer_view(self, layer: int) -> KVLayerView:
        """The cache tensors of one layer."""

    # -- accounting -------------------------------------------------------------
    @abstractmethod
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` could grow to hold ``num_tokens`` tokens in total."""

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Grow ``seq``'s storage to hold ``num_tokens`` tokens.

        Returns how many leading tokens already have their K/V stored (a prefix
        cache hit on first allocation; 0 for backends without prefix caching).
        A hit never covers the last token, whose logits must be computed.
        """

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Return everything ``seq`` holds. Freeing an unknown sequence is a no-op."""

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep storage for ``seq``'s first ``num_tokens`` tokens only (speculative decoding:
        the K/V past them belong to rejected draft tokens).

        Backends that hand out storage per block release blocks wholly past ``num_tokens``;
        those slots were never computed for accepted tokens, so they must not enter a prefix
        cache. The default keeps everything: stale slots are overwritten when the sequence
        computes those positions again (the contiguous layout).
        """

    @abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """Block ids of ``seq`` in order."""

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share ``parent``'s stored tokens (copy-on-write backends).

        Backends that implement it list ``"fork"`` in ``capabilities.features``;
        the engine then runs ``n > 1`` samples as forks of the first sequence.
        A later ``allocate`` that would write into a shared block copies it first.
        """
        raise NotImplementedError(f"kvcache backend {self.name!r} cannot fork sequences")

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token
