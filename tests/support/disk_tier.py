"""The disk KV connector opened on a folder, and holding a few blocks (a helper, not a test file)."""

from __future__ import annotations

import random

from lmplug_kvconnector.disk import DiskConnector, DiskOptions

from lmplug.api import KVBlockFormat
from lmplug.testing.kvconnector import block_payload

FMT = KVBlockFormat("tiny:abc", "paged bs=4 layers=2 tensors=2 kv_heads=2 head_dim=8 float32")


def opened(path, fmt: KVBlockFormat = FMT, **options) -> DiskConnector:
    connector = DiskConnector(DiskOptions(path=str(path), **options))
    connector.open(fmt)
    return connector


def stored(path, n: int, seed: int = 0, **options) -> tuple[DiskConnector, dict[int, dict]]:
    """A connector holding ``n`` flushed float32 blocks, and those blocks by key."""
    rng = random.Random(seed)
    connector = opened(path, **options)
    blocks = {rng.getrandbits(128): block_payload("float32", rng) for _ in range(n)}
    for key, payload in blocks.items():
        connector.put(key, payload)
    connector.flush()
    return connector, blocks
