"""Checkpoint readers: every format becomes a ``ModelSource`` (HF names, HF layout)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmplug.errors import ModelLoadError
from lmplug.interfaces.checkpoint import ModelSource


def open_source(path: str | Path, choose_gguf: Callable[[str, str], Any] | None = None) -> ModelSource:
    """Open an HF folder, a .gguf file, or a folder holding exactly one .gguf file.
    ``choose_gguf``: which architecture reads a GGUF (``lmplug.loading.gguf.load_gguf``)."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".gguf" or _is_gguf(path):
            from lmplug.loading.gguf import load_gguf
            return load_gguf(path, choose_gguf)
        raise ModelLoadError(f"{path}: not a GGUF file; give a .gguf file or an HF model folder")
    if path.is_dir():
        if (path / "config.json").exists():
            from lmplug.loading.hf import load_hf_dir
            return load_hf_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            from lmplug.loading.gguf import load_gguf
            return load_gguf(ggufs[0], choose_gguf)
        if len(ggufs) > 1:
            raise ModelLoadError(f"{path} holds several .gguf files ({', '.join(g.name for g in ggufs)}); "
                                 "name one")
        raise ModelLoadError(f"{path}: neither an HF model folder (config.json) nor a folder with a .gguf file")
    raise ModelLoadError(f"{path}: no such file or folder")


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == b"GGUF"


__all__ = ["ModelSource", "open_source"]
