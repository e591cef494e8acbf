"""The plugin manager: entry-point discovery of a third-party plugin (listed, chosen from YAML,
generating through its backend) and the ways loading fails (import errors, API versions, clashes,
unknown names).

Third-party plugins are simulated by real distributions (tests/support/fake_plugins.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from support.fake_plugins import (
    FIRST_PARTY,
    FIRST_PARTY_ATTENTION,
    _need_model_cache,
    attention_backend_module,
    first_party_loaded,
    write_yaml,
)

import lmplug
from lmplug import (
    AttentionBackend,
    ConfigError,
    EngineConfig,
    PluginError,
    SamplingParams,
    hookimpl,
)
from lmplug.config import resolve
from lmplug.plugins import API_VERSION, Registry, get_registry

# -- discovery of a third-party plugin -----------------------------------------------------------


def test_first_party_plugins_come_through_entry_points():
    reg = Registry()
    assert reg.failures == []
    first_party_loaded(reg)
    info = reg.get("attention", "sdpa")
    assert info.plugin == "attention" and info.distribution.startswith("lmplug ")
    assert info.cls.__module__.startswith("lmplug_attention")


def test_fake_distribution_is_discovered_and_listed(fake_plugin):
    reg = Registry()
    assert reg.failures == []
    first_party_loaded(reg)
    info = reg.get("attention", "fake_attn")
    assert info.plugin == "fake"
    assert info.distribution == "fake-lmplug-plugin 0.1"
    assert info.cls.__module__ == "fake_lmplug_plugin"
    assert issubclass(info.cls, AttentionBackend)
    # `auto` still prefers the higher-priority sdpa
    r = resolve(EngineConfig.from_dict({"model": "m"}), device="cpu", dtype="float32", registry=reg)
    assert r.backends["attention"].name != "fake_attn"


def test_fake_plugin_listed_by_cli(fake_plugin, capsys):
    cli = importlib.import_module("lmplug.cli")  # an import failure fails, never skips
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "fake_attn" in ln)
    assert (
        line.split()[0] == "attention"
        and "fake-lmplug-plugin 0.1" in line
        and "kv_layouts=contiguous" in line
    )
    assert "sdpa" in out


def test_fake_backend_selected_from_yaml(fake_plugin, tmp_path):
    path = write_yaml(
        tmp_path,
        """
        model: tiny
        attention: {backend: fake_attn, tag: hello}
    """,
    )
    cfg = EngineConfig.from_yaml(path)
    r = resolve(cfg, device="cpu", dtype="float32", source=str(path))
    att = r.backends["attention"]
    assert att.name == "fake_attn" and att.info.distribution == "fake-lmplug-plugin 0.1"
    assert att.options.tag == "hello"
    assert r.backends["kvcache"].name == "contiguous"
    # its own options are validated by its own Options model
    bad = write_yaml(tmp_path, "model: tiny\nattention: {backend: fake_attn, tga: x}\n")
    with pytest.raises(ConfigError) as exc:
        resolve(EngineConfig.from_yaml(bad), device="cpu", dtype="float32", source=str(bad))
    msg = str(exc.value)
    assert (
        str(bad) in msg
        and "attention.tga" in msg
        and "allowed: tag" in msg
        and "plugin fake" in msg
    )
    # and it says where it runs
    with pytest.raises(ConfigError) as exc:
        resolve(cfg, device="cuda", dtype="float32")
    assert "'fake_attn' does not run on device 'cuda'" in str(exc.value)


# -- an actual generation through the third-party backend ----------------------------------------


PROMPTS = [[1, 5, 9, 33, 77, 12, 200], [1, 42, 42, 42], [1, 7]]


def _generate(model_dir: Path, config: Path) -> tuple[lmplug.LLM, list[list[int]]]:
    llm = lmplug.LLM(model=str(model_dir), config=config)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return llm, [o.token_ids for o in outs]


def test_generation_uses_third_party_backend(fake_plugin, tiny_llama, tmp_path):
    _need_model_cache()
    base = (
        "model: ignored\ndevice: cpu\ndtype: float32\nmax_model_len: 64\nseed: 0\n"
        "kvcache: {backend: contiguous}\n"
    )
    fake_yaml = tmp_path / "fake.yaml"
    fake_yaml.write_text(base + "attention: {backend: fake_attn, tag: gen}\n")
    sdpa_yaml = tmp_path / "sdpa.yaml"
    sdpa_yaml.write_text(base + "attention: {backend: sdpa}\n")

    llm, fake_tokens = _generate(tiny_llama, fake_yaml)
    assert llm.engine.resolved.backends["attention"].name == "fake_attn"
    calls = sys.modules[fake_plugin].CALLS
    assert calls["init"] == 1
    assert calls["layers"] == {0, 1}
    assert calls["forward"] >= 2 * 6 and calls["forward"] % 2 == 0  # both layers, every step

    forward_calls = calls["forward"]
    _, sdpa_tokens = _generate(tiny_llama, sdpa_yaml)
    assert calls["forward"] == forward_calls  # sdpa run did not go through the fake backend
    assert fake_tokens == sdpa_tokens
    assert all(len(t) == 6 for t in fake_tokens)


# -- failure modes -------------------------------------------------------------------------------


def test_plugin_that_fails_to_import(site):
    site(
        "fake-broken-plugin",
        {"broken": "fake_lmplug_broken"},
        {"fake_lmplug_broken": "import lmplug\nraise ImportError('needs flux_capacitor')\n"},
    )
    reg = Registry()
    first_party_loaded(reg)  # the others still load
    assert len(reg.failures) == 1
    failure = reg.failures[0]
    assert failure.plugin == "broken" and failure.distribution == "fake-broken-plugin 0.1"
    text = str(failure)
    assert "'broken'" in text and "fake-broken-plugin 0.1" in text
    assert "ImportError" in text and "flux_capacitor" in text and "fake_lmplug_broken" in text
    # the failure is repeated where a user would look for the backend
    cfg = EngineConfig.from_dict({"model": "m", "attention": {"backend": "broken_attn"}})
    with pytest.raises(ConfigError) as exc:
        resolve(cfg, device="cpu", dtype="float32", registry=reg)
    msg = str(exc.value)
    available = ", ".join(sorted(reg.backends("attention")))
    assert "unknown attention backend 'broken_attn'" in msg and f"available: {available}" in msg
    assert "failed to load" in msg and "flux_capacitor" in msg


def test_plugin_failure_is_logged(site, caplog):
    site(
        "fake-broken-plugin",
        {"broken": "fake_lmplug_broken2"},
        {"fake_lmplug_broken2": "raise RuntimeError('boom at import')\n"},
    )
    with caplog.at_level("WARNING", logger="lmplug.plugins"):
        Registry()
    assert any(
        "boom at import" in r.getMessage() and "fake-broken-plugin" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    "version, expect",
    [
        ("1", "targets lmplug API version 1, but this core implements API version 3"),
        ("2", "targets lmplug API version 2, but this core implements API version 3"),
        ("4", "targets lmplug API version 4, but this core implements API version 3"),
        (None, "does not declare LMPLUG_API_VERSION (this core implements API version 3)"),
    ],
)
def test_plugin_with_wrong_or_missing_api_version(site, version, expect):
    site(
        "fake-old-plugin",
        {"old": "fake_lmplug_old"},
        {"fake_lmplug_old": attention_backend_module("old_attn", version)},
    )
    reg = Registry()
    first_party_loaded(reg)
    assert [f.plugin for f in reg.failures] == ["old"]
    text = str(reg.failures[0])
    assert "'old'" in text and "fake-old-plugin 0.1" in text and expect in text
    assert "old_attn" not in reg.backends("attention")  # nothing of it is registered
    assert reg.pm.get_plugin("old") is None


# plugins written for an older API: each imports what that API offered and this one moved
OLD_API_PLUGINS = {
    1: ("""
from lmplug import hookimpl
from lmplug.engine.sequence import Sequence  # API 1: engine internals were importable

LMPLUG_API_VERSION = 1
""", "'lmplug.engine.sequence'"),
    2: ("""
from lmplug.hookspecs import hookimpl
from lmplug.interfaces import AttentionBackend, Capabilities  # API 2: the contract's package

LMPLUG_API_VERSION = 2
""", "'lmplug.interfaces'"),
}


@pytest.mark.parametrize("version", sorted(OLD_API_PLUGINS))
def test_plugin_written_for_an_older_api_gets_a_version_error_not_a_bare_import_error(site, version):
    source, missing = OLD_API_PLUGINS[version]
    name = f"api{version}"
    site(f"fake-{name}-plugin", {name: f"fake_lmplug_{name}"}, {f"fake_lmplug_{name}": source})
    reg = Registry()
    first_party_loaded(reg)
    assert [f.plugin for f in reg.failures] == [name]
    text = str(reg.failures[0])
    assert f"fake-{name}-plugin 0.1" in text and "targets an older lmplug API" in text
    assert missing in text and "API version 3" in text
    assert "lmplug.api" in text and "Porting a plugin" in text
    assert reg.pm.get_plugin(name) is None


def test_two_backends_with_the_same_name(site):
    site(
        "fake-dup-one",
        {"dup_one": "fake_lmplug_dup_one"},
        {"fake_lmplug_dup_one": attention_backend_module("twin")},
    )
    site(
        "fake-dup-two",
        {"dup_two": "fake_lmplug_dup_two"},
        {"fake_lmplug_dup_two": attention_backend_module("twin")},
        version="2.0",
    )
    reg = Registry()
    assert reg.failures == []
    with pytest.raises(PluginError) as exc:
        reg.backends("attention")
    msg = str(exc.value)
    assert "two attention backends are named 'twin'" in msg
    assert "fake-dup-one 0.1" in msg and "fake-dup-two 2.0" in msg
    assert "'dup_one'" in msg and "'dup_two'" in msg


def test_same_backend_name_in_different_families_is_fine():
    from lmplug.api import Capabilities, KVCacheBackend

    class Kv(KVCacheBackend):
        name = "sdpa"  # same name as the attention backend, other family
        capabilities = Capabilities(kv_layouts=frozenset({"contiguous"}))

    class P:
        LMPLUG_API_VERSION = API_VERSION

        @hookimpl
        def lmplug_register_kvcache_backends(self):
            return [Kv]

    reg = Registry()
    assert reg.register(P(), name="kv-named-sdpa")
    assert reg.get("kvcache", "sdpa").cls is Kv
    assert reg.get("attention", "sdpa").plugin == "attention"


def test_entry_point_name_taken_by_another_distribution(site):
    # a third-party distribution reusing a first-party entry-point name must not vanish silently
    # (nor silently replace the first-party plugin): one of them loads, the other is reported
    site(
        "fake-clash",
        {"attention": "fake_lmplug_clash"},
        {"fake_lmplug_clash": attention_backend_module("clash_attn")},
    )
    reg = Registry()
    assert FIRST_PARTY <= set(dict(reg.pm.list_name_plugin()))
    assert len(reg.failures) == 1, reg.failures
    failure = reg.failures[0]
    loaded = reg.backends("attention")
    assert set(loaded) in (FIRST_PARTY_ATTENTION, {"clash_attn"})
    winner = next(iter(loaded.values())).distribution
    assert failure.plugin == "attention"
    assert {failure.distribution, winner} == {"fake-clash 0.1", "lmplug 0.2.0"}
    text = str(failure)
    assert "'attention'" in text and "fake-clash 0.1" in text and "lmplug 0.2.0" in text
    assert "already taken" in text
    # loading again reports nothing new
    reg.load_entry_points()
    assert len(reg.failures) == 1


def test_loading_twice_is_harmless(fake_plugin):
    reg = Registry()
    reg.load_entry_points()
    assert reg.failures == []
    assert reg.get("attention", "fake_attn").plugin == "fake"


def test_unknown_backend_name_in_config(fake_plugin, tmp_path):
    path = write_yaml(tmp_path, "model: tiny\nattention: {backend: flash_attn}\n")
    with pytest.raises(ConfigError) as exc:
        resolve(EngineConfig.from_yaml(path), device="cpu", dtype="float32", source=str(path))
    msg = str(exc.value)
    assert str(path) in msg and "attention" in msg and "'flash_attn'" in msg
    assert f"available: {', '.join(sorted(get_registry().backends('attention')))}" in msg
    assert "fake_attn" in msg and "sdpa" in msg


def test_unknown_family():
    with pytest.raises(PluginError) as exc:
        Registry().backends("sampler")
    assert "'sampler'" in str(exc.value) and "attention" in str(exc.value)
