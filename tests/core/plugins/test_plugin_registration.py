"""The plugin manager: what a registration hook may return, and attention / KV layout compatibility."""

from __future__ import annotations

import pytest
from support.fake_plugins import FIRST_PARTY_ATTENTION, simple_plugin, write_yaml

import lmplug
from lmplug import AttentionBackend, ConfigError, EngineConfig, hookimpl
from lmplug.config import resolve
from lmplug.plugins import API_VERSION, Registry

# -- what a registration hook may return ---------------------------------------------------


class _NotABackend:
    name = "nope"


class _NoCapabilities(AttentionBackend):
    name = "no_caps"

    def forward(self, *a):  # pragma: no cover
        raise NotImplementedError


class _BadOptions(AttentionBackend):
    from lmplug import Capabilities as _C

    name = "bad_options"
    capabilities = _C(kv_layouts=frozenset({"contiguous"}))
    Options = dict

    def forward(self, *a):  # pragma: no cover
        raise NotImplementedError


class _KvNotAttention(lmplug.KVCacheBackend):
    from lmplug import Capabilities as _C

    name = "kv_in_wrong_family"
    capabilities = _C()


def _returning(*values):
    class P:
        LMPLUG_API_VERSION = API_VERSION

        @hookimpl
        def lmplug_register_attention_backends(self):
            return list(values)

    return P()


@pytest.mark.parametrize(
    "value, expect",
    [
        ("sdpa", "returned 'sdpa' for attention, which is not a subclass of AttentionBackend"),
        (_NotABackend, "which is not a subclass of AttentionBackend"),
        (_KvNotAttention, "which is not a subclass of AttentionBackend"),
        (_NotABackend(), "which is not a subclass of AttentionBackend"),
        (_NoCapabilities, "attention backend 'no_caps' has no `capabilities`"),
        (_BadOptions, "`Options` must subclass lmplug.BackendOptions"),
    ],
)
def test_registration_hook_returning_a_non_backend(value, expect):
    reg = Registry()
    assert reg.register(_returning(value), name="weird")
    table = reg.backends("attention")
    assert set(table) == FIRST_PARTY_ATTENTION  # the bad entry is skipped, the rest works
    assert len(reg.failures) == 1
    text = str(reg.failures[0])
    assert "'weird'" in text and "<in-process>" in text and expect in text


def test_registration_hook_returning_a_bare_class():
    """A common slip: ``return MyBackend`` instead of ``return [MyBackend]``."""
    import lmplug_attention.sdpa

    class P:
        LMPLUG_API_VERSION = API_VERSION

        @hookimpl
        def lmplug_register_attention_backends(self):
            return lmplug_attention.sdpa.SdpaAttention

    reg = Registry()
    assert reg.register(P(), name="bare")
    assert set(reg.backends("attention")) == FIRST_PARTY_ATTENTION
    assert [f.plugin for f in reg.failures] == ["bare"]
    assert "list" in reg.failures[0].error and "SdpaAttention" in reg.failures[0].error


def test_registration_hook_that_raises():
    class P:
        LMPLUG_API_VERSION = API_VERSION

        @hookimpl
        def lmplug_register_attention_backends(self):
            raise KeyError("missing kernel")

    reg = Registry()
    reg.register(P(), name="raiser")
    assert set(reg.backends("attention")) == FIRST_PARTY_ATTENTION
    text = str(reg.failures[0])
    assert "'raiser'" in text and "lmplug_register_attention_backends raised KeyError" in text
    assert "missing kernel" in text


def test_failures_are_not_repeated_when_the_table_is_rebuilt():
    reg = Registry()
    reg.register(_returning(_NotABackend), name="weird")
    reg.backends("attention")
    reg.register(_returning(), name="empty")  # invalidates the table
    reg.backends("attention")
    assert len(reg.failures) == 1


def test_register_rejects_unknown_hook():
    class P:
        LMPLUG_API_VERSION = API_VERSION

        @hookimpl
        def lmplug_register_samplers(self):  # no such hook
            return []

    reg = Registry()
    assert not reg.register(P(), name="typo")
    text = str(reg.failures[0])
    assert "'typo'" in text and "lmplug_register_samplers" in text


# -- layout compatibility --------------------------------------------------------------------------


def test_attention_layout_must_match_kvcache(site, tmp_path):
    site(
        "fake-paged",
        {"paged": "fake_lmplug_paged"},
        {
            "fake_lmplug_paged": simple_plugin("""
        from lmplug import AttentionBackend, Capabilities

        class PagedOnly(AttentionBackend):
            name = "paged_only"
            capabilities = Capabilities(kv_layouts=frozenset({"paged"}), priority=99)
            def forward(self, layer, q, k, v, kv, ctx):
                raise NotImplementedError

        @hookimpl
        def lmplug_register_attention_backends():
            return [PagedOnly]
    """)
        },
    )
    path = write_yaml(
        tmp_path, "model: m\nattention: {backend: paged_only}\nkvcache: {backend: contiguous}\n"
    )
    with pytest.raises(ConfigError) as exc:
        resolve(EngineConfig.from_yaml(path), device="cpu", dtype="float32", source=str(path))
    msg = str(exc.value)
    assert str(path) in msg
    assert "attention backend 'paged_only' (plugin paged)" in msg and "['paged']" in msg
    assert "kvcache backend 'contiguous' (plugin kvcache)" in msg and "['contiguous']" in msg
    # with `auto` the incompatible one is passed over despite its priority
    r = resolve(
        EngineConfig.from_dict({"model": "m", "kvcache": {"backend": "contiguous"}}),
        device="cpu",
        dtype="float32",
    )
    assert r.backends["attention"].name != "paged_only"
    assert "contiguous" in r.backends["attention"].cls.capabilities.kv_layouts


def test_the_family_table_matches_the_hookspecs_and_the_config():
    """One table of families: every row's hook is a registration spec in ``lmplug.hookspecs``
    (and every registration spec has a row), FAMILIES and the config sections derive from it."""
    import inspect

    from lmplug import hookspecs
    from lmplug.config import OPTIONAL_SECTIONS, SECTIONS
    from lmplug.families import FAMILIES, TABLE

    specs = {name for name, fn in vars(hookspecs).items()
             if name.startswith("lmplug_register_") and hasattr(fn, "lmplug_spec")}
    assert {h for f in TABLE for h in (f.hook, *f.old_hooks)} == specs
    for family in TABLE:
        assert inspect.signature(getattr(hookspecs, family.hook)).parameters == {}
    assert FAMILIES == {f.name: f.base for f in TABLE}
    assert SECTIONS == {"kvcache": ("kvcache", "backend"), "kvconnector": ("kvconnector", "backend"),
                        "attention": ("attention", "backend"),
                        "scheduler": ("scheduler", "backend"), "quant": ("quant", "method"),
                        "speculative": ("speculative", "method"), "moe": ("moe", "backend"),
                        "mixer": ("mixer", "backend"), "constraint": ("constraint", "backend"), "compression": ("compression", "method"),
                        "lora": ("adapter", "backend")}
    assert list(SECTIONS).index("kvcache") < list(SECTIONS).index("attention")  # attention's auto reads it
    assert OPTIONAL_SECTIONS == {"quant", "speculative", "moe", "mixer", "compression", "kvconnector", "lora"}
    assert set(SECTIONS) <= set(EngineConfig.model_fields)


def test_auto_records_why():
    """Each chosen backend carries why: named in the config, or auto's candidates and priorities."""
    r = resolve(EngineConfig.from_dict({"model": "m", "kvcache": {"backend": "contiguous"}}),
                device="cpu", dtype="float32")
    assert r.reasons["kvcache"] == "named in the config"
    assert r.reasons["attention"].startswith("auto: fit device cpu, dtype float32, KV layout contiguous")
    assert f"{r.backends['attention'].name} (" in r.reasons["attention"]
    assert r.reasons["attention"].endswith("highest priority wins")
    with pytest.raises(TypeError):
        r.backends["attention"] = r.backends["kvcache"]  # the resolution is immutable
