"""KV connectors: tiers a KV cache's blocks move to and come back from (``kvconnector:`` section).

A KV backend that lists the ``"kv_connector"`` feature takes a connector
(``lmplug.kit.kv_extras.ConnectorTier.attach_connector``) and, with prefix caching on, writes every full block it
computes through to it, keyed by the block's prefix hash (the chain of its tokens and every
token before it), and, when a new prompt's prefix runs past what its own pool still holds,
asks the connector for the following blocks before computing them. A block that comes back
must hold exactly what was written, or nothing: a connector that cannot vouch for an entry
(missing, truncated, written for another model or layout) answers ``None`` and the engine
computes the block again.

``KVBlockFormat`` names what a block holds: the model (``model``: a digest of its config and
weight files, dtype included, made by the core) and the backend's layout of one block
(``layout``: block size, layers, heads, head size, storage dtype). Connectors keep entries of
different formats apart (``KVBlockFormat.digest``) and refuse an entry whose recorded format
differs. The payload of one block is a small dict of CPU tensors the KV backend defines (its
K/V slice and, when quantized, its scales).

Puts may complete after they return (a worker thread); ``flush`` waits for them. Gets are
synchronous: they run before the step that would otherwise compute the block.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities


@dataclass(frozen=True)
class KVBlockFormat:
    model: str  # the model's identity (config, weight files, dtype), from the core
    layout: str  # the KV backend's block layout, e.g. "paged bs=16 layers=30 kv_heads=3 head_dim=64 float32"

    @property
    def digest(self) -> str:
        """A short name for this format (a folder, a key prefix)."""
        return hashlib.sha256(f"{self.model}\n{self.layout}".encode()).hexdigest()[:24]


class KVConnector(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.format: KVBlockFormat | None = None

    def open(self, fmt: KVBlockFormat) -> None:
        """Called once by the KV backend before any put or get: the format of its blocks.
        Raise ``ConfigError`` for a tier that cannot be used (e.g. a folder that cannot be written)."""
        self.format = fmt

    @abstractmethod
    def put(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        """Store one block (``key``: its 128-bit prefix hash) unless it is already stored. The
        tensors are the caller's copies; the connector may keep them. May return before the
        write completes; a failed write is logged and dropped, never raised."""

    @abstractmethod
    def get(self, key: int) -> dict[str, torch.Tensor] | None:
        """The block stored under ``key``, exactly as put, or None (absent, unreadable, foreign)."""

    @abstractmethod
    def contains(self, key: int) -> bool:
        """Whether ``get(key)`` would probably succeed (cheap: no payload read)."""

    def flush(self) -> None:
        """Wait until every put so far is stored (or dropped)."""

    def close(self) -> None:
        """Flush and release resources; called when the engine stops."""
        self.flush()

    def stats(self) -> dict[str, int]:
        """Counters for logs and benchmarks (e.g. puts, hits, misses, bytes)."""
        return {}
