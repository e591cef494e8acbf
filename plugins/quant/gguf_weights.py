"""Where a GGUF weight's rows live while the native kernels stream them: a copy made once at bind
in huge pages (``lmplug.kit.hugemem``: the AVX-512 panels, or the rows as they are for the other
kernel sets), cached by weight so that a layer's bound product and the native step's share it,
with the file's pages of the rows given back (``release_file_pages``): resident memory holds one
copy of each weight.

A file's mapping is in 4 KiB pages, whatever the kernel: each page costs a page walk and stops the
prefetchers at its end. The copy is skipped where huge pages are off (``hugemem.enabled()``):
then it would be the same 4 KiB pages twice.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import weakref
from collections.abc import Callable

import torch

from lmplug.kit import hugemem

_copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (form, weight's key) -> its copy


def cached_copy(form: str, w: torch.Tensor, ggml_type: int, k: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``w``'s copy in ``form`` (``"panels"``, ``"rows"``), made once by ``make`` while any holder
    keeps it; ``w``'s file pages are then released (``lmplug_rows_in_file`` says so)."""
    key = (form, w.data_ptr(), w.stride(0), w.shape[0], ggml_type, k)
    found = _copies.get(key)
    if found is not None:
        return found
    out = make()
    out.lmplug_source = w  # the rows stay alive while their copy is cached: no address reuse
    _copies[key] = out
    out.lmplug_rows_in_file = release_file_pages(w)
    return out


def forget_source(w: torch.Tensor, ggml_type: int, k: int) -> bool:
    """Where a copy of ``w`` exists and ``w`` is memory of this process's own (a copy made at
    load: llama's permuted q/k joined with v) rather than the file's mapping: the copies and the
    cache forget ``w``, so it is freed once its holder drops it. True when so; False leaves ``w``
    as it is (rows in the file's mapping: their pages were released when the copy was made)."""
    forgot = False
    for form in ("panels", "rows"):
        key = (form, w.data_ptr(), w.stride(0), w.shape[0], ggml_type, k)
        found = _copies.get(key)
        if found is not None and not found.lmplug_rows_in_file:
            del _copies[key], found.lmplug_source
            forgot = True
    return forgot


def hot_rows(w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """``w``'s rows as a kernel streams them: a contiguous copy in huge pages, made once (shared
    as ``cached_copy`` shares), where ``hugemem.enabled()``; else ``w`` itself."""
    if not hugemem.enabled() or w.numel() == 0:
        return w

    def make() -> torch.Tensor:
        return hugemem.empty(w.shape[0] * w.shape[1]).view(w.shape[0], w.shape[1]).copy_(w)
    return cached_copy("rows", w, ggml_type, k, make)


MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def release_file_pages(w: torch.Tensor) -> bool:
    """Drop this process's pages of ``w``'s rows when they lie in a read-only file mapping (the
    GGUF's memory map), once its copy is made (panels, rows in huge pages): the resident memory
    then holds the copy, not a second one of the weights. The rows stay valid: a later read (an embedding lookup of
    the tied head, the op path) faults its pages back in from the file. Memory of any other kind
    (a copy made at load: permuted q/k rows, joined shards) is left alone. True when released."""
    if not sys.platform.startswith("linux") or w.numel() == 0:
        return False
    page = mmap.PAGESIZE
    start = w.data_ptr()
    end = start + (w.shape[0] - 1) * w.stride(0) + w.shape[1]
    lo, hi = -(-start // page) * page, end // page * page  # the whole pages inside the rows
    if hi <= lo:
        return False
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                first, last = (int(a, 16) for a in fields[0].split("-"))
                if first <= lo < last:
                    if hi > last or fields[1][1] != "-" or fields[4] == "0" or len(fields) < 6:
                        return False  # writable, anonymous, or not one mapping: keep it
                    return _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0
    except OSError:
        return False
    return False


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc
