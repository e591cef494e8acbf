"""Where the Triton kernel tests run, and which of their cases a device can run.

A kernel test runs on one device: the CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
which tests/conftest.py sets when no CUDA GPU is visible), or a CUDA GPU with the kernels compiled
(the interpreter off). Tests take the ``kernel_device`` fixture (tests/conftest.py), parametrized
by ``kernel_devices()``, so the same correctness checks run interpreted on a laptop and compiled on
a lent GPU (``make gpu-check``). Architecture limits are asked of
``lmplug.kit.devices.capability``, as the kernels themselves do.
"""

from __future__ import annotations

import os

import pytest
import torch

from lmplug.kit.devices import capability, describe

BF16_INTERPRETER = ("bf16 tl.dot returns garbage under TRITON_INTERPRET=1 (a Triton interpreter bug, "
                    "docs/triton-on-cpu.md); bf16 runs compiled on a CUDA GPU only")


def interpreted() -> bool:
    """Triton's interpreter is on: kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def kernel_devices() -> list[str]:
    """``["cpu"]`` under the interpreter, ``["cuda"]`` with a GPU and the interpreter off, else none."""
    if interpreted():
        return ["cpu"]
    return ["cuda"] if torch.cuda.is_available() else []


def kernel_device() -> str | None:
    """The one device the kernel tests run on here (None: nowhere)."""
    devices = kernel_devices()
    return devices[0] if devices else None


NO_KERNEL_DEVICE = "the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"


def bf16_problem(device: str | None) -> str | None:
    """Why bf16 kernel cases cannot run on ``device`` (None: they can)."""
    if device is None:
        return NO_KERNEL_DEVICE
    if device == "cpu":
        return BF16_INTERPRETER
    cap = capability(device)
    if cap is None or cap < (8, 0):
        return f"bf16 needs compute capability 8.0+ (sm_80); this GPU is {describe(cap)}"
    return None


def fp8_problem(device: str | None) -> str | None:
    """Why fp8 (e4m3) kernel cases cannot run on ``device`` (None: they can; the interpreter can)."""
    if device is None:
        return NO_KERNEL_DEVICE
    if device == "cpu":
        return None
    cap = capability(device)
    if cap is None or cap < (8, 9):
        return f"fp8 e4m3 needs compute capability 8.9+ (sm_89: Ada, Hopper); this GPU is {describe(cap)}"
    return None


def bf16_param(*values, id: str = "bf16"):
    """A ``pytest.param`` of ``values`` (default: ``torch.bfloat16``) for a bf16 case: skipped, with
    the reason, where bf16 kernels cannot run."""
    why = bf16_problem(kernel_device())
    return pytest.param(*(values or (torch.bfloat16,)), id=id,
                        marks=pytest.mark.skipif(why is not None, reason=why or ""))


def skip_unless_fp8(device: str) -> None:
    """Inside a test: skip, with the reason, when ``device`` cannot run fp8 kernels."""
    why = fp8_problem(device)
    if why:
        pytest.skip(why)
