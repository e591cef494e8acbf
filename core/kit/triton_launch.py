"""Launch helpers the first-party Triton kernels share (attention and state-layer mixers): the
per-architecture launch table's lookup, constexpr bucketing, dot precision, head padding.
Pure Python: importing this module imports no Triton."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels take

T = TypeVar("T")


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def arch_entry(table: Mapping[tuple[int, int] | None, T], cap: tuple[int, int] | None) -> T:
    """``table``'s entry for a GPU of compute capability ``cap``: the newest architecture listed
    that is not newer than ``cap`` (sm_86 / sm_89 take sm_80's entry, sm_100 sm_90's), the
    oldest listed one for an older GPU, and the ``None`` entry (the interpreter's) for no GPU.
    Entries for sm_80 stay within 99 KiB of shared memory, so sm_86 / sm_89 can launch them."""
    if cap is None:
        return table[None]
    listed = sorted(k for k in table if k is not None)
    older = [k for k in listed if k <= tuple(cap)]
    return table[older[-1] if older else listed[0]]


def bucket(n: int, floor: int, cap: int) -> int:
    """``n`` rounded up to a power of two and clamped to ``[floor, cap]`` (powers of two): a
    constexpr computed this way from a context length or a split count takes at most
    ``log2(cap / floor) + 1`` values, so serving compiles each kernel a bounded number of times."""
    return max(floor, min(cap, next_power_of_2(max(n, 1))))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would otherwise be rounded to tf32 on NVIDIA GPUs: not exact enough for a reference
    return "ieee" if dtype == torch.float32 else "tf32"


def head_dim_pad(head_dim: int) -> int:
    """The head dim a tile holds: the next power of two (>= 16 for tl.dot); extra lanes are masked."""
    return max(16, next_power_of_2(head_dim))


def check_power_of_two(value: int, name: str, what: str, minimum: int = 16) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{what}: {name} must be a power of two >= {minimum}, got {value}")
