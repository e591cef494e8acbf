"""Engine configs for the config tests (a helper module, not a test file): a YAML file written
from text, and an ``EngineConfig`` from keyword sections."""

from __future__ import annotations

import textwrap
from pathlib import Path

from lmplug import EngineConfig


def write(tmp_path: Path, text: str, name: str = "engine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def cfg(**kw) -> EngineConfig:
    return EngineConfig.from_dict({"model": "m", **kw})
