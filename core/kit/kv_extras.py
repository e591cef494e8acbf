"""First-party KV-cache extras a backend may opt into, and a third party never has to implement.

``lmplug.api.KVCacheBackend`` is the small interface every KV cache implements (layout, views,
accounting). Forking, swap space, a connector's tier, copies repeated on tensor-parallel ranks,
state slots, a pool sized at construction and prefix sharing are mixins here: a backend lists one
among its bases (and the feature it implements in ``capabilities.features``; the registry refuses
a feature without its mixin), and the core and the first-party scheduler ask through the functions
below, which answer "no" for a backend without the mixin.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lmplug.interfaces.common import BackendOptions
    from lmplug.interfaces.kvconnector import KVConnector
    from lmplug.interfaces.sequence import Sequence
    from lmplug.interfaces.state import StatePool


class Forks(ABC):
    """Features "fork" (copy-on-write blocks: the engine runs ``n > 1`` samples as forks of the
    first sequence) or "fork_copy" (a child's rows copied: beams)."""

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share (or hold a copy of) ``parent``'s stored tokens. A later
        ``allocate`` that would write into a shared block copies it first."""


class SwapSpace(ABC):
    """Feature "swap" (``scheduler: {preemption: swap}``): a preempted sequence's K/V kept aside."""

    @abstractmethod
    def swap_out(self, seq: Sequence) -> bool:
        """Move ``seq``'s computed K/V (and state) out of the pool into swap space and release its
        blocks, keeping ``seq.num_computed_tokens``; ``swap_in`` brings it back. False: not swapped
        (no room, or nothing to keep) and nothing changed; the caller frees and recomputes it."""

    @abstractmethod
    def is_swapped(self, seq: Sequence) -> bool: ...

    @abstractmethod
    def swap_in(self, seq: Sequence) -> None:
        """Allocate ``seq``'s computed tokens again and restore what ``swap_out`` kept (check
        ``can_allocate(seq, seq.num_computed_tokens + n)`` first). ``free`` drops swapped data."""


class ConnectorTier(ABC):
    """Feature "kv_connector": computed blocks written through to a connector's tier."""

    @abstractmethod
    def attach_connector(self, connector: KVConnector, model: str) -> None:
        """Write computed blocks through to ``connector`` and serve prefix blocks missing from
        the pool from it (``lmplug.api.KVConnector``); ``model``: the model's identity for
        ``KVBlockFormat``."""


class CopyRecording(ABC):
    """Feature "tp_copies": the copies between stored tokens this cache makes itself (a
    copy-on-write block, a forked row), repeated by the other ranks of a tensor-parallel group,
    whose pools (their own KV heads, the same block ids) must make the same copies."""

    @abstractmethod
    def record_copies(self) -> None:
        """Keep, from now on, every copy this cache makes for ``take_copies`` (rank 0 calls it)."""

    @abstractmethod
    def take_copies(self) -> Any:
        """The copies recorded since the last call, in order (None: none), for ``apply_copies``."""

    @abstractmethod
    def apply_copies(self, copies: Any) -> None:
        """Make, on this rank's pool, the copies rank 0's ``take_copies`` returned."""


class StateSlots:
    """Feature "state": the per-sequence states of state layers (``KVCacheSpec.states``), one
    ``StatePool`` the backend builds and keeps in step with its accounting."""

    states: StatePool | None = None

    def state_view(self, index: int) -> dict[str, torch.Tensor]:
        """State layer ``index``'s pools by tensor name, ``[num_slots, *shape]`` each."""
        if self.states is None:
            raise NotImplementedError(f"kvcache backend {self.name!r} keeps no per-sequence state")
        return self.states.layer(index)

    def state_slot(self, seq: Sequence) -> int:
        """The state slot ``seq`` holds (from its first ``allocate`` until ``free``)."""
        if self.states is None:
            raise NotImplementedError(f"kvcache backend {self.name!r} keeps no per-sequence state")
        return self.states.slot(seq.seq_id)


class SizedPool(ABC):
    """A pool whose size is decided at construction (e.g. from free memory), which the plan fits
    ``max_model_len`` to and tensor-parallel ranks build again."""

    @abstractmethod
    def pool_blocks(self) -> int | None:
        """Blocks this cache allocated; None: fixed by the options and spec alone."""

    @classmethod
    @abstractmethod
    def with_pool_blocks(cls, options: BackendOptions, blocks: int) -> BackendOptions:
        """``options`` that allocate exactly ``blocks`` blocks."""


class PrefixSharing(ABC):
    """A cache that can share blocks by prefix, which a drafter's cache must not."""

    @classmethod
    @abstractmethod
    def draft_options(cls, options: BackendOptions) -> BackendOptions:
        """The options of a drafter's cache of this class (``DraftTarget.new_kv_cache``): the same,
        less any sharing of blocks by prefix (a draft's blocks may hold rejected tokens)."""


# a feature a KV cache lists -> the mixin that implements it (the registry holds the pair)
FEATURE_MIXINS: dict[str, type] = {"fork": Forks, "fork_copy": Forks, "swap": SwapSpace,
                                   "kv_connector": ConnectorTier, "tp_copies": CopyRecording,
                                   "state": StateSlots}


def missing_mixins(cls: type, features: frozenset[str]) -> list[str]:
    """``feature (Mixin)`` for each of ``features`` whose mixin ``cls`` lacks."""
    return [f"{f} ({m.__name__})" for f, m in sorted(FEATURE_MIXINS.items())
            if f in features and not issubclass(cls, m)]


def is_swapped(kv: object, seq: Sequence) -> bool:
    return isinstance(kv, SwapSpace) and kv.is_swapped(seq)


def swap_out(kv: object, seq: Sequence) -> bool:
    """False (nothing changed) for a cache without swap space."""
    return isinstance(kv, SwapSpace) and kv.swap_out(seq)


def take_copies(kv: object) -> Any:
    return kv.take_copies() if isinstance(kv, CopyRecording) else None


def pool_blocks(kv: object) -> int | None:
    return kv.pool_blocks() if isinstance(kv, SizedPool) else None


def with_pool_blocks(cls: type, options: BackendOptions, blocks: int) -> BackendOptions:
    return cls.with_pool_blocks(options, blocks) if issubclass(cls, SizedPool) else options


def draft_options(cls: type, options: BackendOptions) -> BackendOptions:
    return cls.draft_options(options) if issubclass(cls, PrefixSharing) else options
