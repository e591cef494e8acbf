"""Fixtures of the plugin-manager tests: a clean plugin environment around every test, a
temporary site-packages folder to install fake distributions in, and a tiny Llama checkpoint."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from support.fake_plugins import FAKE_ATTENTION, make_dist

from lmplug.plugins import ENV_ALLOWLIST, ENV_DISABLE_AUTOLOAD, reset_registry


@pytest.fixture(autouse=True)
def _isolate(monkeypatch):
    """No plugin env from the caller; a fresh process-wide registry; fake modules forgotten."""
    monkeypatch.delenv(ENV_ALLOWLIST, raising=False)
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    reset_registry()
    yield
    reset_registry()
    for mod in [m for m in sys.modules if m.startswith("fake_lmplug")]:
        del sys.modules[mod]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh site-packages-like folder on ``sys.path``; returns a function adding dists."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def add(dist: str, entry_points: dict[str, str], modules: dict[str, str], version: str = "0.1"):
        make_dist(root, dist, entry_points, modules, version)
        importlib.invalidate_caches()

    return add


@pytest.fixture
def fake_plugin(site):
    site(
        "fake-lmplug-plugin", {"fake": "fake_lmplug_plugin"}, {"fake_lmplug_plugin": FAKE_ATTENTION}
    )
    return "fake_lmplug_plugin"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    import torch

    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path
