"""The KV-cache interface is small; first-party extras are opt-in mixins (``lmplug.kit.kv_extras``)
the registry pairs with the features they implement, and the core asks a cache without them "no"."""

from __future__ import annotations

import torch
from support.fake_plugins import plugin_module

from lmplug.api import (
    Capabilities,
    KVCacheBackend,
    KVCacheSpec,
    KVLayerView,
    SamplingParams,
    Sequence,
)
from lmplug.hookspecs import hookimpl
from lmplug.kit import kv_extras
from lmplug.plugins import Registry

INTERFACE = {"layout", "block_size", "layer_view", "can_allocate", "allocate", "free", "block_table", "usage",
             "truncate", "close", "kv_dtype_of", "bytes_per_token"}


class Minimal(KVCacheBackend):
    """What a third party writes: the eight abstract methods, one block per sequence."""

    name = "minimal"
    capabilities = Capabilities(kv_layouts=frozenset({"paged"}))

    def __init__(self, options, spec):
        super().__init__(options, spec)
        k = torch.zeros(spec.max_num_seqs, spec.max_model_len, spec.num_kv_heads, spec.head_dim)
        self._view, self._rows = KVLayerView(k, k.clone(), "paged"), {}

    layout = "paged"

    @property
    def block_size(self):
        return self.spec.max_model_len

    def layer_view(self, layer):
        return self._view

    def can_allocate(self, seq, num_tokens):
        return seq.seq_id in self._rows or len(self._rows) < self.spec.max_num_seqs

    def allocate(self, seq, num_tokens):
        self._rows.setdefault(seq.seq_id, len(self._rows))
        return 0

    def free(self, seq):
        self._rows.pop(seq.seq_id, None)

    def block_table(self, seq):
        return [self._rows[seq.seq_id]]

    @property
    def usage(self):
        return len(self._rows) / self.spec.max_num_seqs


def _spec() -> KVCacheSpec:
    return KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                       max_model_len=8, max_num_seqs=2)


def test_the_interface_is_eight_abstract_methods_and_four_defaults():
    public = {n for n in dir(KVCacheBackend) if not n.startswith("_")} - {"name", "capabilities", "Options"}
    assert public == INTERFACE
    assert set(KVCacheBackend.__abstractmethods__) == INTERFACE - {"truncate", "close", "kv_dtype_of",
                                                                    "bytes_per_token"}


def test_a_cache_without_extras_is_asked_no():
    kv = Minimal(Minimal.Options(), _spec())
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    kv.allocate(seq, 3)
    assert not kv_extras.swap_out(kv, seq) and not kv_extras.is_swapped(kv, seq)
    assert kv.block_table(seq) == [0]  # swap_out changed nothing
    assert kv_extras.pool_blocks(kv) is None and kv_extras.take_copies(kv) is None
    opts = Minimal.Options()
    assert kv_extras.draft_options(Minimal, opts) is opts
    assert kv_extras.with_pool_blocks(Minimal, opts, 7) is opts


def test_the_first_party_caches_carry_the_mixins_of_their_features():
    from lmplug_kvcache.contiguous import ContiguousKVCache
    from lmplug_kvcache.paged import PagedKVCache

    for cls in (PagedKVCache, ContiguousKVCache):
        assert kv_extras.missing_mixins(cls, cls.capabilities.features) == []
    assert issubclass(PagedKVCache, (kv_extras.SwapSpace, kv_extras.SizedPool, kv_extras.PrefixSharing))


def _register(cls) -> Registry:
    reg = Registry(autoload=False)
    assert reg.register(plugin_module(lmplug_register_kvcache_backends=hookimpl(lambda: [cls])), name="kvp")
    return reg


def test_a_feature_without_its_mixin_is_refused_at_load_naming_both():
    claims = type("Claims", (Minimal,), {"name": "claims", "capabilities": Capabilities(
        kv_layouts=frozenset({"paged"}), features=frozenset({"fork", "swap", "prefix_caching"}))})
    reg = _register(claims)
    assert "claims" not in reg.backends("kvcache")
    [failure] = reg.failures
    assert "fork (Forks)" in str(failure) and "swap (SwapSpace)" in str(failure)
    assert "lmplug.kit.kv_extras" in str(failure) and "prefix_caching" not in str(failure)

    class Forking(Minimal, kv_extras.Forks):
        name = "forking"
        capabilities = Capabilities(kv_layouts=frozenset({"paged"}), features=frozenset({"fork"}))

        def fork(self, parent, child):
            self._rows[child.seq_id] = self._rows[parent.seq_id]

    reg = _register(Forking)
    assert reg.backends("kvcache")["forking"].cls is Forking and not reg.failures
