"""A file mapping's pages given back once their bytes were copied (``release_file_pages``).

A GGUF's tensors are views of the file's read-only memory map; a weight the loader or a quant
method copies (a row permutation, shards joined that do not lie back to back, a kernel's repacked
panels) reads its rows in, and the file's pages would stay resident beside the copy: the weights
twice in memory. Released, they are read back from the file only if something reads the rows again.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def release_file_pages(w: torch.Tensor) -> bool:
    """Drop this process's pages of ``w``'s rows (``[rows, bytes]``, rows ``stride(0)`` apart) when
    they lie in a read-only file mapping, once a copy of them is made: the resident memory then
    holds the copy, not a second one. The rows stay valid: a later read (an embedding lookup of
    the tied head, the op path) faults its pages back in from the file. Memory of any other kind
    (a copy made at load: permuted q/k rows, joined shards) is left alone. True when released."""
    if not sys.platform.startswith("linux") or w.numel() == 0 or w.dim() != 2:
        return False
    page = mmap.PAGESIZE
    start = w.data_ptr()
    end = start + (w.shape[0] - 1) * w.stride(0) + w.shape[1] * w.element_size()
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
