"""docs/hooks.md is generated from core/hookspecs.py (and the core's call sites); keep it current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_hooks", DOCS / "gen_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hooks_doc_is_current():
    gen = _generator()
    assert (DOCS / "hooks.md").read_text() == gen.render(), (
        "docs/hooks.md is stale: run `.venv/bin/python docs/gen_hooks.py`"
    )


def test_every_hook_is_documented():
    from lmplug import hookspecs

    text = (DOCS / "hooks.md").read_text()
    hooks = [name for name in vars(hookspecs) if name.startswith("lmplug_")]
    assert len(hooks) >= 10
    for name in hooks:
        assert f"### `{name}`" in text
