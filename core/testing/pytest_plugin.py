"""The pytest plugin behind ``lmplug.testing``, registered under the ``pytest11`` entry point.

pytest loads it in every project where lmplug is installed. It

- changes nothing in a project that does not use the suite: ``TRITON_INTERPRET=1`` (Triton
  backends on the CPU under the interpreter, on machines without a GPU) is set only when a test
  module asks ``lmplug.testing`` for a conformance class before triton is imported
  (``for_conformance``), or at start when asked: ``LMPLUG_TRITON_INTERPRET=auto`` (without a
  GPU) or ``=1`` (always); ``=0`` never sets it; an explicit ``TRITON_INTERPRET`` wins;
- registers the ``lmplug_conformance`` marker that every conformance test
  carries (``pytest -m lmplug_conformance`` runs just the suite);
- reports in pytest's header what it decided.

Importing it imports the ``lmplug`` package (and so torch), but not the
suite's modules or hypothesis: those load when a test module asks for a
conformance class.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ENV_CHOICE = "LMPLUG_TRITON_INTERPRET"


def _gpu_present() -> bool:
    """A look for an NVIDIA or AMD GPU that needs no CUDA initialisation when torch is absent."""
    if "torch" in sys.modules:
        return bool(sys.modules["torch"].cuda.is_available())
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (
        (nvidia.is_dir() and any(nvidia.iterdir()))
        or Path("/dev/kfd").exists()
        or Path("/dev/nvidia0").exists()
    )


def _choose_interpreter(choice: str) -> str:
    if "TRITON_INTERPRET" in os.environ:
        return f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} (from the environment)"
    if choice in ("0", "false", "no", "off"):
        return f"TRITON_INTERPRET not set ({ENV_CHOICE}={choice})"
    if choice == "auto" and _gpu_present():
        return "TRITON_INTERPRET not set (a GPU is present)"
    if "triton" in sys.modules:
        return "TRITON_INTERPRET not set: triton was imported before the lmplug pytest plugin"
    os.environ["TRITON_INTERPRET"] = "1"
    why = "no GPU found" if choice == "auto" else f"{ENV_CHOICE}={choice}"
    return f"TRITON_INTERPRET=1 set by lmplug.testing ({why})"


# At import, only when asked: pytest imports entry-point plugins before conftest files, which may
# import triton. Otherwise the environment is left alone until a conformance class is asked for.
_asked = os.environ.get(ENV_CHOICE, "").strip().lower()
_decision = (_choose_interpreter(_asked) if _asked else
             f"TRITON_INTERPRET left alone (set for conformance tests; {ENV_CHOICE}=auto|1|0 decides at start)")


def for_conformance() -> None:
    """A test asked for a conformance class: without a GPU, run Triton under the interpreter
    (unless the environment or ``LMPLUG_TRITON_INTERPRET`` decided already)."""
    global _decision, _asked
    if not _asked:
        _asked = "auto"
        _decision = _choose_interpreter("auto")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "lmplug_conformance: a test of the lmplug conformance suite (lmplug.testing)"
    )


def pytest_collection_modifyitems(config, items) -> None:
    """Conformance classes list ``known_failures``: mark those tests as expected (strict) failures."""
    import pytest

    for item in items:
        known = getattr(getattr(item, "cls", None), "known_failures", None)
        if not isinstance(known, dict):
            continue
        for pattern, reason in known.items():
            if _matches(item.name, pattern):
                item.add_marker(pytest.mark.xfail(reason=f"known failure: {reason}", strict=True))
                break


def _matches(name: str, pattern: str) -> bool:
    """Glob with ``*`` only: test ids contain ``[`` and ``]``, which fnmatch would treat as a set."""
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, name) is not None


def pytest_report_header(config) -> str:
    try:
        from importlib.metadata import version

        where = f"lmplug {version('lmplug')}"
    except Exception:  # noqa: BLE001  # pragma: no cover - running from a source tree without metadata
        where = "lmplug (version unknown)"
    return f"{where} conformance suite: {_decision}"
