"""Simulated third-party plugins for the plugin-manager tests (a helper module, not a test file).

Third-party plugins are real distributions on a temporary ``sys.path`` entry (a ``*.dist-info``
folder with ``METADATA`` and ``entry_points.txt`` next to the plugin module), so discovery goes
through ``importlib_metadata`` exactly as for an installed package. The fixtures that install
them (``site``, ``fake_plugin``) are in tests/core/plugins/conftest.py.
"""

from __future__ import annotations

import importlib.util
import textwrap
import types
from pathlib import Path

from lmplug.plugins import API_VERSION, ENTRY_POINT_GROUP, Registry

FIRST_PARTY = {"attention", "mixer", "adapter", "kvcache", "scheduler", "quant", "speculative", "moe", "constraint", "compression", "models", "transformers",
               "kvconnector"}
FAMILIES = ("attention", "kvcache", "scheduler", "quant", "speculative", "moe")


def _first_party_attention() -> set[str]:
    reg = Registry(autoload=False)
    assert reg.register(importlib.import_module("lmplug_attention"), name="attention")
    return set(reg.backends("attention"))


FIRST_PARTY_ATTENTION = _first_party_attention()


# -- fake distributions ------------------------------------------------------------------------

FAKE_ATTENTION = '''
"""A third-party attention backend: a thin wrapper around the sdpa math that counts calls."""
import torch
from pydantic import Field

from lmplug.api import AttentionBackend, BackendOptions, Capabilities, hookimpl

LMPLUG_API_VERSION = 3
CALLS = {"init": 0, "forward": 0, "layers": set()}


class FakeOptions(BackendOptions):
    tag: str = Field(default="none", description="an option only this backend has")


class FakeAttention(AttentionBackend):
    name = "fake_attn"
    capabilities = Capabilities(devices=frozenset({"cpu"}), kv_layouts=frozenset({"contiguous"}),
                                priority=1)  # below sdpa: `auto` must not pick it
    Options = FakeOptions

    def __init__(self, options, **dims):
        super().__init__(options, **dims)
        from lmplug_attention.sdpa import SdpaAttention
        self._inner = SdpaAttention(BackendOptions(), **dims)
        CALLS["init"] += 1

    def forward(self, layer, q, k, v, kv, ctx):
        CALLS["forward"] += 1
        CALLS["layers"].add(layer)
        return self._inner.forward(layer, q, k, v, kv, ctx)


@hookimpl
def lmplug_register_attention_backends():
    return [FakeAttention]
'''


def make_dist(
    root: Path,
    dist: str,
    entry_points: dict[str, str],
    modules: dict[str, str],
    version: str = "0.1",
) -> Path:
    """Write distribution ``dist`` (entry points ``name -> module``) and its modules in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{eps}")
    for mod, source in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))
    return root


def plugin_module(**hooks) -> types.ModuleType:
    """An in-process plugin module with ``hooks`` (name -> hookimpl), as an entry point would load it."""
    module = types.ModuleType("fake_plugin")
    module.LMPLUG_API_VERSION = API_VERSION
    for name, impl in hooks.items():
        setattr(module, name, impl)
    return module


def simple_plugin(body: str = "", version: str | None = str(API_VERSION)) -> str:
    head = "from lmplug.api import hookimpl\n"
    if version is not None:
        head += f"LMPLUG_API_VERSION = {version}\n"
    return head + textwrap.dedent(body)


def attention_backend_module(backend_name: str, version: str | None = str(API_VERSION)) -> str:
    return simple_plugin(
        f"""
        from lmplug.api import AttentionBackend, Capabilities

        class A(AttentionBackend):
            name = {backend_name!r}
            capabilities = Capabilities(kv_layouts=frozenset({{"contiguous"}}))
            def forward(self, layer, q, k, v, kv, ctx):
                raise NotImplementedError

        @hookimpl
        def lmplug_register_attention_backends():
            return [A]
    """,
        version,
    )


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def first_party_loaded(reg: Registry) -> None:
    assert FIRST_PARTY <= set(dict(reg.pm.list_name_plugin()))
    assert "sdpa" in reg.backends("attention")
    assert "contiguous" in reg.backends("kvcache")
    assert "static" in reg.backends("scheduler")


def _need_model_cache() -> None:
    importlib.import_module("lmplug.loading.cache")  # an import failure fails the test, never skips it
