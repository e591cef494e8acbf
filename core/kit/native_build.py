"""Build, cache and load a plugin's C source as a shared library (the native CPU kernels).

A kernel is compiled on first use with ``$CC`` (default ``cc``; it may carry a launcher such
as ``ccache gcc``) into ``<cache_dir>/kernels/<stem>-<hash>.so``. The hash covers the source
(and the C files and headers beside it, which it may include), the flags, the compiler's ``--version`` and the CPU's model and feature lines
(``-march=native`` code from another CPU may not run here, and virtual machines often report
one model name for different feature sets). The build writes a temporary file in the same
folder and renames it, so a process never loads a half-written library.

It lives in the contract so that every plugin family can use it (families share no module
otherwise). Everything that goes wrong raises ``NativeBuildError`` with the reason: no
compiler, a compile error (with the compiler's output), a library that does not load.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


class NativeBuildError(RuntimeError):
    """A native kernel cannot be built or loaded here; the message says why."""


# the kernels this process may use, declared by their modules at import: built up front at engine
# load (``build_declared``) so that no compile lands inside a timed generation
_declared: dict[str, Callable[[], object]] = {}
_compile_seconds = [0.0]  # spent in the compiler by this process (one-time cost, never decoding)


def declare(name: str, load: Callable[[], object]) -> None:
    """Register ``load`` (builds when not cached, then loads; may raise NativeBuildError)."""
    _declared[name] = load


def compile_seconds() -> float:
    """Seconds this process has spent compiling kernels so far."""
    return _compile_seconds[0]


def build_declared() -> float:
    """Build and load every declared kernel; the seconds spent compiling (0.0: all cached). A
    kernel that cannot build here is left to its module, which falls back and says why on use."""
    before = compile_seconds()
    for load in list(_declared.values()):
        try:
            load()
        except NativeBuildError:
            pass
    return compile_seconds() - before


def compiler() -> tuple[str, ...]:
    """``$CC`` split into words, default ``cc``."""
    return tuple(shlex.split(os.environ.get("CC") or "cc"))


def cpu_id() -> str:
    """The CPU's model and feature-flag lines (Linux), else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    picked = {line.split(":")[0].strip(): line for line in lines if line.split(":")[0].strip() in keys}
    if picked:
        return "\n".join(picked[k] for k in keys if k in picked)
    import platform

    return f"{platform.machine()} {platform.processor()}"


def missing_flags(isa_flags: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Per SIMD kernel set, the features it needs (as /proc/cpuinfo names them) that its flags
    line lacks; a need written ``a|b`` is met by either."""
    flags = set(cpu_id().replace("_", "").split())
    return {name: [f for f in need if not any(alt.replace("_", "") in flags for alt in f.split("|"))]
            for name, need in isa_flags.items()}


def bounded_isa(cpuid_best: str, isas: tuple[str, ...], isa_flags: dict[str, tuple[str, ...]]) -> str:
    """The best of a kernel's ``isas`` (lowest first, each needing the one below it) that both
    the CPU (``cpuid_best``: the C library's own CPUID check) and the operating system's
    /proc/cpuinfo flags report: a feature the kernel turned off is missing there. CPUID's answer
    alone where there is no flags line (not Linux)."""
    if not any(line.startswith(("flags", "Features")) for line in cpu_id().splitlines()):
        return cpuid_best
    missing, best = missing_flags(isa_flags), isas[0]
    for name in isas[1:isas.index(cpuid_best) + 1]:
        if missing[name]:
            break
        best = name
    return best


@functools.cache
def compiler_version(cc: tuple[str, ...]) -> str:
    """``cc --version``'s output; NativeBuildError when it cannot run."""
    try:
        done = subprocess.run([*cc, "--version"], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"no C compiler: running {shlex.join(cc)!r} failed ({exc}); "
                               f"set $CC to one") from exc
    if done.returncode != 0:
        raise NativeBuildError(f"no C compiler: '{shlex.join(cc)} --version' exited with "
                               f"{done.returncode}: {done.stderr.strip()[-500:]}; set $CC to one")
    return done.stdout


def library_path(source: Path, flags: tuple[str, ...], cc: tuple[str, ...], root: Path) -> Path:
    """Where the build of ``source`` for these flags, this compiler and this CPU lives."""
    digest = hashlib.sha256()
    # the files a source #includes live beside it: every C file and header there counts
    siblings = sorted(p for p in source.parent.iterdir() if p.suffix in (".c", ".h") and p != source)
    for part in (source.read_bytes(), *(p.read_bytes() for p in siblings), "\0".join(flags).encode(), compiler_version(cc).encode(),
                 cpu_id().encode()):
        digest.update(part)
        digest.update(b"\0")
    return root / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def shared_library(source: Path, flags: tuple[str, ...], cc: tuple[str, ...],
                   root: Path) -> tuple[ctypes.CDLL, str]:
    """The loaded library and its path, built first when not cached under ``root``."""
    if not sys.platform.startswith(("linux", "darwin")):
        raise NativeBuildError(f"unsupported platform {sys.platform!r} (Linux and macOS only)")
    path = library_path(source, flags, cc, root)
    if not path.exists():
        _build(source, flags, cc, path)
    try:
        return ctypes.CDLL(str(path)), str(path)
    except OSError as exc:
        raise NativeBuildError(f"cannot load {path}: {exc}") from exc


def _build(source: Path, flags: tuple[str, ...], cc: tuple[str, ...], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        command = [*cc, *flags, "-o", tmp, str(source)]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeBuildError(f"compiling {source.name} failed: {exc}") from exc
        finally:
            _compile_seconds[0] += time.perf_counter() - started
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-2000:]
            raise NativeBuildError(f"compiling {source.name} failed ('{shlex.join(command)}' "
                                   f"exited with {done.returncode}): {tail}")
        os.replace(tmp, path)  # atomic: another process sees the old state or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
