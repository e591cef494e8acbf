"""The plugin manager's allowlist (``LMPLUG_PLUGINS``) and switching autoload off."""

from __future__ import annotations

import pytest
from support.fake_plugins import FAMILIES, FIRST_PARTY

from lmplug import ConfigError, EngineConfig
from lmplug.config import resolve
from lmplug.plugins import ENV_ALLOWLIST, ENV_DISABLE_AUTOLOAD, Registry, get_registry

# -- the allowlist and switching autoload off -----------------------------------------------------


def test_allowlist_by_entry_point_name(fake_plugin, monkeypatch):
    monkeypatch.setenv(ENV_ALLOWLIST, "attention, kvcache")
    reg = Registry()
    assert set(dict(reg.pm.list_name_plugin())) == {"attention", "kvcache"}
    assert "sdpa" in reg.backends("attention") and "fake_attn" not in reg.backends("attention")
    assert "contiguous" in reg.backends("kvcache")
    assert {i.plugin for i in reg.backends("attention").values()} == {"attention"}
    assert reg.backends("scheduler") == {}
    with pytest.raises(ConfigError) as exc:
        resolve(EngineConfig.from_dict({"model": "m"}), device="cpu", dtype="float32", registry=reg)
    assert "no scheduler backend" in str(exc.value) and "none installed" in str(exc.value)


@pytest.mark.parametrize(
    "spelling", ["fake-lmplug-plugin", "fake_lmplug_plugin", "Fake.LMPLUG-plugin"]
)
def test_allowlist_by_distribution_name(fake_plugin, monkeypatch, spelling):
    monkeypatch.setenv(ENV_ALLOWLIST, spelling)
    reg = Registry()
    assert set(dict(reg.pm.list_name_plugin())) == {"fake"}
    assert set(reg.backends("attention")) == {"fake_attn"}


def test_allowlist_covers_all_first_party_via_distribution(fake_plugin, monkeypatch):
    monkeypatch.setenv(ENV_ALLOWLIST, "lmplug")
    reg = Registry()
    assert set(dict(reg.pm.list_name_plugin())) == FIRST_PARTY
    assert "fake_attn" not in reg.backends("attention")


def test_disable_autoload(fake_plugin, monkeypatch):
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    reg = Registry()
    assert dict(reg.pm.list_name_plugin()) == {}
    assert all(reg.backends(f) == {} for f in FAMILIES)
    assert reg.failures == []
    with pytest.raises(ConfigError) as exc:
        resolve(EngineConfig.from_dict({"model": "m"}), device="cpu", dtype="float32", registry=reg)
    assert "none installed" in str(exc.value)
    # get_registry() honours it too
    assert dict(get_registry().pm.list_name_plugin()) == {}


@pytest.mark.parametrize("value", ["0", "false", "no", ""])
def test_disable_autoload_falsy_values(monkeypatch, value):
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, value)
    assert FIRST_PARTY <= set(dict(Registry().pm.list_name_plugin()))


def test_disable_autoload_with_allowlist(fake_plugin, monkeypatch):
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    monkeypatch.setenv(ENV_ALLOWLIST, "fake")
    reg = Registry()
    assert set(dict(reg.pm.list_name_plugin())) == {"fake"}


def test_autoload_false_loads_nothing(fake_plugin):
    reg = Registry(autoload=False)
    assert dict(reg.pm.list_name_plugin()) == {}
    import lmplug_attention

    assert reg.register(lmplug_attention, name="attention")
    assert "sdpa" in reg.backends("attention")
    assert reg.get("attention", "sdpa").distribution == "<in-process>"
