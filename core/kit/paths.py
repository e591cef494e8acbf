"""Where lmplug and its plugins keep files between runs (models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$LMPLUG_CACHE`` or ``~/.cache/lmplug``."""
    override = os.environ.get("LMPLUG_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "lmplug"
