"""The first-party kvcache backends through the conformance suite (``lmplug.testing.KVCacheConformance``)."""

from __future__ import annotations

from typing import ClassVar

from lmplug.testing import KVCacheConformance, StateCacheConformance

# -- KV storage -------------------------------------------------------------------------------------


class TestContiguousKVCache(KVCacheConformance):
    backend = "contiguous"


class TestPagedKVCache(KVCacheConformance):
    backend = "paged"
    options: ClassVar[dict] = {"num_blocks": 48, "block_size": 4}
    features = frozenset({"fork"})  # prefix caching is an option, off by default


class TestPagedKVCachePrefixCaching(KVCacheConformance):
    backend = "paged"
    options: ClassVar[dict] = {"num_blocks": 48, "block_size": 4, "prefix_caching": True}


# -- per-sequence state slots (linear-attention / SSM layers) -----------------------------------------


class TestContiguousStateCache(StateCacheConformance):
    backend = "contiguous"


class TestPagedStateCache(StateCacheConformance):
    backend = "paged"
    options: ClassVar[dict] = {"num_blocks": 48, "block_size": 4}
