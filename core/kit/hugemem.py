"""Memory for the weights a CPU kernel streams every token, in transparent huge pages.

A batch-1 decode step reads every weight once. In 4 KiB pages the core walks the page table every
4 KiB it streams and its prefetchers stop at each page's end; in 2 MiB pages neither happens (on
a 2-core EPYC the AVX-512 Q4_0 GEMV over a 1B model's weights went from 13-16 to 20-25 GB/s). Linux
gives anonymous memory huge pages where the mapping asks for them (``madvise(MADV_HUGEPAGE)``,
honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``: ``thp_mode``); a
file's pages (a mapped GGUF file) stay 4 KiB, which is why kernels read repacked copies.

``empty(nbytes)`` cuts a uint8 tensor out of an arena: a private anonymous mapping of ``ARENA_BYTES``
that starts on a 2 MiB boundary, cut in 64-byte-aligned pieces, so that many small weights (a
135M model's) share huge pages instead of each wasting the rest of its own; a piece of an arena's
size or more gets a mapping of its own (at most the rest of its last huge page unused), freed
with it rather than kept as the arena the next pieces are cut from. What an arena never hands out
is never touched, so it costs address space, not memory. Each piece holds its arena, which is
unmapped once every piece of it is gone. Off Linux, where transparent huge pages are ``never``, or
with ``LMPLUG_HUGE_PAGES=0`` (to measure what they give), it is ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
# each arena ends in a huge page its pieces fill only in part (on average 1 MiB resident, unused):
# with 32 MiB arenas a 1B model's weights (about 19 arenas) peaked 39 MiB above 4 KiB pages (AVX2 rows),
# with 256 MiB 30 MiB below (bench_vs_llamacpp.py --sizes --sections cold); the untouched rest of
# an arena costs address space only
ARENA_BYTES = 256 << 20
ALIGN = 64  # a cache line: the kernels' aligned loads

_lock = threading.Lock()
_arena: list = [None, 0]  # (the current arena's 2 MiB-aligned uint8 tensor, bytes used of it)


def enabled() -> bool:
    """Whether ``empty`` hands out huge-page memory here (Linux with transparent huge pages not
    ``never``, and not turned off): where not, a copy made for huge pages would gain nothing."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("LMPLUG_HUGE_PAGES", "1") != "0" and thp_mode() in ("always", "madvise"))


@functools.cache
def thp_mode() -> str | None:
    """The transparent huge pages mode Linux reports (``always``, ``madvise``, ``never``), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start = text.find("[")
    return text[start + 1:text.find("]", start)] if start >= 0 else None


def _map(nbytes: int) -> torch.Tensor:
    """``nbytes`` (rounded up to huge pages) of a fresh private mapping that asks for huge pages, from a 2 MiB boundary."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds ``region``: unmapped when no view remains
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + size]


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes``, 64-byte aligned, in huge-page memory where
    ``enabled()`` (else ``torch.empty``)."""
    if not enabled() or nbytes <= 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    with torch.inference_mode(False):  # a normal tensor even when the first caller is inside a forward
        return _carve(nbytes)


def _carve(nbytes: int) -> torch.Tensor:
    if nbytes >= ARENA_BYTES:
        return _map(nbytes)[:nbytes]
    with _lock:
        arena, used = _arena
        if arena is None or used + nbytes > arena.numel():
            arena, used = _map(ARENA_BYTES), 0
        _arena[:] = [arena, -(-(used + nbytes) // ALIGN) * ALIGN]
        return arena[used:used + nbytes]


def huge_bytes() -> int:
    """This process's anonymous memory in huge pages now (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``; 0 where Linux does not say): whether the pages were granted."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``): a model's load
    frees much heap (file reads, copies made before repacking) that glibc would otherwise keep
    resident beside the weights (on a 1B GGUF file about 66 MiB of peak RSS). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass
