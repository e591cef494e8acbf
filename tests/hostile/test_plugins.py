"""Hostile plugins, installed as real distributions on a temporary path: an import that raises
SystemExit or KeyboardInterrupt is contained; a plugin outranking the first-party backends is
named at start-up; an LMPLUG_PLUGINS that matches nothing says so."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys

import pytest
from support.fake_plugins import FAKE_ATTENTION, FIRST_PARTY, make_dist

from lmplug import ConfigError, EngineConfig
from lmplug.config import resolve
from lmplug.engine.plan import log_choices
from lmplug.plugins import ENV_ALLOWLIST, ENV_DISABLE_AUTOLOAD, Registry, reset_registry


@pytest.fixture(autouse=True)
def _isolate(monkeypatch):
    monkeypatch.delenv(ENV_ALLOWLIST, raising=False)
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    reset_registry()
    yield
    reset_registry()
    for mod in [m for m in sys.modules if m.startswith("hostile_lmplug")]:
        del sys.modules[mod]


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    monkeypatch.syspath_prepend(str(root))

    def add(dist: str, module: str, source: str):
        make_dist(root, dist, {module: module}, {module: source})
        importlib.invalidate_caches()

    return add, root


@pytest.mark.parametrize("raised", ["SystemExit(3)", "KeyboardInterrupt()", "type('Odd', (BaseException,), {})()"])
def test_plugin_ending_the_process_at_import_is_contained(site, raised):
    add, _ = site
    add("hostile-lmplug-exit", "hostile_lmplug_exit", f"raise {raised}\n")
    reg = Registry()
    assert FIRST_PARTY <= set(dict(reg.pm.list_name_plugin()))
    (failure,) = reg.failures
    assert failure.plugin == "hostile_lmplug_exit" and "contained" in failure.error
    assert raised.split("(")[0].strip("'") in failure.error or "Odd" in failure.error


def test_plugin_exit_does_not_end_commands(site):
    add, root = site
    add("hostile-lmplug-exit", "hostile_lmplug_exit", "raise SystemExit(3)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "lmplug.cli", "plugins"], check=False, capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 1, proc.stderr  # listed, with the failure named; not a silent rc 3
    assert "sdpa" in proc.stdout and "hostile_lmplug_exit" in proc.stderr and "SystemExit" in proc.stderr


def test_higher_priority_plugin_is_named_at_start_up(site, caplog):
    add, _ = site
    add("hostile-lmplug-fast", "hostile_lmplug_fast", FAKE_ATTENTION.replace("priority=1)", "priority=1000)"))
    resolved = resolve(EngineConfig.from_dict({"model": "m"}), device="cpu", dtype="float32", registry=Registry())
    assert resolved.backends["attention"].name == "fake_attn"  # it wins `auto` ...
    with caplog.at_level(logging.INFO, logger="lmplug.engine.plan"):
        log_choices(resolved)
    line = next(r for r in caplog.records if ": attention: " in r.getMessage())
    msg = line.getMessage()
    assert line.levelno == logging.WARNING  # ... and says so without -v
    assert "'fake_attn' from hostile-lmplug-fast 0.1, priority 1000" in msg
    assert "sdpa (lmplug " in msg and "priority" in msg.split("sdpa (lmplug ")[1]  # the runner-up


def test_allowlist_matching_nothing_names_the_variable(monkeypatch, caplog):
    monkeypatch.setenv(ENV_ALLOWLIST, "atention")
    with caplog.at_level(logging.WARNING, logger="lmplug.plugins"):
        reg = Registry()
    assert any(ENV_ALLOWLIST in r.getMessage() and "'atention'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError) as exc:
        resolve(EngineConfig.from_dict({"model": "m"}), device="cpu", dtype="float32", registry=reg)
    msg = str(exc.value)
    assert "none installed" in msg and ENV_ALLOWLIST in msg and "attention (lmplug)" in msg
    with pytest.raises(Exception, match=ENV_ALLOWLIST):
        reg.get("attention", "sdpa")
