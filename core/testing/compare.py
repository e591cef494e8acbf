"""Closeness checks that say where and by how much, for failure messages a plugin author can act on."""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import pytest
import torch

# (atol, rtol) per dtype, for outputs of magnitude about 1.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class Mismatch:
    num_bad: int
    numel: int
    index: tuple[int, ...]  # the worst element
    actual: float
    expected: float
    error: float
    allowed: float
    num_nonfinite: int

    def summary(self, atol: float, rtol: float) -> str:
        where = ", ".join(map(str, self.index))
        text = (
            f"{self.num_bad} of {self.numel} values outside tolerance; max abs error "
            f"{self.error:.3g} vs allowed {self.allowed:.3g} (atol {atol:g}, rtol {rtol:g}) "
            f"at index [{where}]: got {self.actual:.6g}, expected {self.expected:.6g}"
        )
        if self.num_nonfinite:
            text += f"; {self.num_nonfinite} values are NaN or inf"
        return text


def find_mismatch(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float
) -> Mismatch | None:
    """None if every element satisfies ``|a - e| <= atol + rtol * |e|`` (NaN never does)."""
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    allowed = atol + rtol * e.abs()
    err = torch.where(torch.isfinite(a), err, torch.full_like(err, float("inf")))
    bad = ~(err <= allowed)
    if not bad.any():
        return None
    excess = torch.where(bad, err - allowed, torch.full_like(err, float("-inf")))
    flat = int(excess.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    return Mismatch(
        int(bad.sum()),
        a.numel(),
        index,
        float(a[index]),
        float(e[index]),
        float(err[index]),
        float(allowed[index]),
        int((~torch.isfinite(a)).sum()),
    )


def fail(message: str) -> None:
    """Fail the current test with ``message`` only: no traceback into the suite's internals,
    and no chained "during handling of the above exception" (the message already says it)."""
    raise pytest.fail.Exception(message, pytrace=False) from None


class ContractViolation(AssertionError):
    """A backend broke its contract; the message says how and where."""


class reported:
    """Context manager: a ``ContractViolation`` fails the test with its message alone; any other
    error from the backend fails it with ``label``, the error and the last frames that raised it."""

    def __init__(self, label: str) -> None:
        self.label = label

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if not isinstance(exc, Exception):
            return False
        if isinstance(exc, ContractViolation):
            fail(str(exc))
        frames = "".join(traceback.format_exception(exc, limit=-3))
        fail(f"{self.label}: {type(exc).__name__}: {exc}\n{frames}")
        return False


def tolerance_for(table: dict[str, tuple[float, float]], dtype: str) -> tuple[float, float]:
    return table.get(dtype, DEFAULT_TOLERANCES.get(dtype, (1e-2, 1e-2)))
