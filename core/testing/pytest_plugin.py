"""The pytest plugin behind ``lmplug.testing``, registered under the ``pytest11`` entry point.

pytest loads it in every project where lmplug is installed. It

- sets ``TRITON_INTERPRET=1`` on machines without a GPU, before any conftest
  or test module can import triton (so Triton backends run on the CPU under
  the interpreter). ``LMPLUG_TRITON_INTERPRET=0`` leaves the environment
  alone, ``=1`` forces the interpreter; an explicit ``TRITON_INTERPRET`` wins;
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


def _choose_interpreter() -> str:
    choice = os.environ.get(ENV_CHOICE, "auto").strip().lower()
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


# At import: pytest imports entry-point plugins before conftest files, which may import triton.
_decision = _choose_interpreter()


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
