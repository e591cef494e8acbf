"""``host``: a tier of KV blocks in host memory (``kvconnector: {backend: host, memory_gb: 4}``).

Blocks are kept as the CPU tensors the KV cache hands over, in LRU order, up to ``memory_gb``;
the least recently used go first when a put needs room. On a GPU this is the tier below the
device pool (pinned memory, so copies back overlap nothing else but are fast); on a CPU-only
machine it is a second, larger pool: prefixes evicted from the KV pool come back from here
instead of being recomputed. Nothing survives the process (``disk`` does).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from pydantic import Field

from lmplug.api import BackendOptions, Capabilities, KVConnector


class HostOptions(BackendOptions):
    memory_gb: float = Field(default=4.0, gt=0, description="host memory for blocks, in GiB (LRU beyond it)")
    pin_memory: bool = Field(default=True, description="pin the block copies when CUDA is available")


class HostConnector(KVConnector):
    name = "host"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), priority=10)
    Options = HostOptions

    def __init__(self, options: HostOptions) -> None:
        super().__init__(options)
        self.limit = int(options.memory_gb * 2**30)
        self._blocks: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()  # LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._counts = {"puts": 0, "hits": 0, "misses": 0, "evictions": 0}
        self._pin = options.pin_memory and torch.cuda.is_available()

    def put(self, key: int, payload: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in payload.values())
        if size > self.limit:
            return
        if self._pin:
            payload = {name: t.pin_memory() for name, t in payload.items()}
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            while self._bytes + size > self.limit:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= sum(t.numel() * t.element_size() for t in old.values())
                self._counts["evictions"] += 1
            self._blocks[key] = payload
            self._bytes += size
            self._counts["puts"] += 1

    def get(self, key: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            payload = self._blocks.get(key)
            if payload is None:
                self._counts["misses"] += 1
                return None
            self._blocks.move_to_end(key)
            self._counts["hits"] += 1
            return payload

    def contains(self, key: int) -> bool:
        with self._lock:
            return key in self._blocks

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "blocks": len(self._blocks), "bytes": self._bytes}
