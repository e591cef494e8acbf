"""Where a GGUF weight's rows live while the native kernels stream them: a copy made once at bind
in huge pages (``lmplug.kit.hugemem``: the panels of the x86 sets, or the rows as they are for
NEON's), cached by weight so that a layer's bound product and the native step's share it,
with the file's pages of the rows given back (``release_file_pages``): resident memory holds one
copy of each weight.

A file's mapping is in 4 KiB pages, whatever the kernel: each page costs a page walk and stops the
prefetchers at its end. The copy is skipped where huge pages are off (``hugemem.enabled()``):
then it would be the same 4 KiB pages twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from lmplug.kit import hugemem
from lmplug.kit.file_pages import release_file_pages

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
