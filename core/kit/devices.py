"""What GPU a kernel is built for: the compute capability that launch tables are keyed by.

Kernels pick their launch configuration (tile sizes, warps, stages, split-K) per architecture,
and some configurations a GPU cannot run at all (fp8 before sm_89, bf16 before sm_80). Every
such decision asks ``capability(device)`` rather than ``torch.cuda`` directly, so that the
compile check (``make gpu-compile``) can build each kernel for sm_80 and sm_90 on a machine
without a GPU: inside ``target_capability((9, 0))`` every call answers ``(9, 0)``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_OVERRIDE: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "lmplug_target_capability", default=None)


def capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """The CUDA compute capability ``(major, minor)`` kernels for ``device`` are built for; None
    for a CPU (or a machine without CUDA), unless ``target_capability`` says otherwise."""
    forced = _OVERRIDE.get()
    if forced is not None:
        return forced
    if device is not None and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def describe(cap: tuple[int, int] | None) -> str:
    """``sm_90 (compute capability 9.0)``, or ``no CUDA GPU``."""
    return "no CUDA GPU" if cap is None else f"sm_{cap[0]}{cap[1]} (compute capability {cap[0]}.{cap[1]})"


@contextlib.contextmanager
def target_capability(cap: tuple[int, int]) -> Iterator[None]:
    """Within the block, ``capability()`` answers ``cap`` whatever the machine has."""
    token = _OVERRIDE.set(tuple(cap))  # type: ignore[arg-type]
    try:
        yield
    finally:
        _OVERRIDE.reset(token)
