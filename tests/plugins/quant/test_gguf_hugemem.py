"""The SIMD GGUF kernel sets over rows (NEON; on x86, where every set reads panels, the sets made to
bind rows as NEON's do) bound over a copy of the rows in huge pages (``gguf_weights.hot_rows``): the same bits as over the rows where they lie
(``LMPLUG_HUGE_PAGES=0``, and the portable set, which reads them there), one copy shared by a layer's bound product and its native-step
product, the file's pages given back, and a copy made at load forgotten for the one in huge pages
(the op path then reads that one)."""

from __future__ import annotations

import sys

import pytest
import torch
from support.gguf_weights import file_rows, make_weight, resident_kib, type_id

from lmplug.kit import hugemem

gguf_native = pytest.importorskip("lmplug_quant.gguf_native")
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


@pytest.fixture
def huge(monkeypatch):
    monkeypatch.delenv("LMPLUG_HUGE_PAGES", raising=False)
    if not hugemem.enabled():
        pytest.skip("no huge-page memory here (not Linux): the rows are read where they lie")


def row_sets(kernel, monkeypatch, name: str) -> list[str]:
    """The SIMD kernel sets this CPU runs that read ``name``'s rows (not panels). Where none does
    (x86: every set reads panels), the sets bind rows as NEON's do, for this test (their
    ``panel_types`` emptied): the C repacks such rows per call, the same bits."""
    simd = gguf_native.ISAS[1:gguf_native.ISAS.index(kernel.best_isa) + 1]
    if not simd:
        pytest.skip(f"no SIMD kernel set runs here: {gguf_native.describe_isa(kernel.best_isa)}")
    sets = [isa for isa in simd if type_id(name) not in kernel.panel_types[isa]]
    if not sets:
        monkeypatch.setattr(kernel, "panel_types", {isa: frozenset() for isa in kernel.panel_types})
        sets = list(simd)
    return sets


@pytest.mark.parametrize("name", TYPES)
def test_rows_in_huge_pages_give_the_same_bits(kernel, huge, monkeypatch, name):
    from lmplug.kit.native import call_product

    k, n = 512, 37
    whole = torch.from_numpy(make_weight(name, 2 * n, k, seed=5))
    w = whole[::2]  # rows apart: the copy is contiguous, its stride the kernel's
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
    assert gguf_native.BoundProduct(kernel, w, type_id(name), k).w is w  # the portable set reads them in place
    for isa in row_sets(kernel, monkeypatch, name):
        monkeypatch.setenv("LMPLUG_GGUF_ISA", isa)
        monkeypatch.setenv("LMPLUG_HUGE_PAGES", "0")
        off = gguf_native.BoundProduct(kernel, w, type_id(name), k)
        assert off.w is w and off.stride == w.stride(0)
        monkeypatch.delenv("LMPLUG_HUGE_PAGES")
        on = gguf_native.BoundProduct(kernel, w, type_id(name), k)
        assert on.w.data_ptr() != w.data_ptr() and on.w.is_contiguous() and torch.equal(on.w, w)
        assert on.stride == w.shape[1] and on.w.data_ptr() % hugemem.ALIGN == 0
        call = gguf_native.layer_product(kernel, [(type_id(name), w)], k, None)
        assert call.keep[0].runs[0].w == on.w.data_ptr()  # the native step reads the bound product's copy
        for m in (1, 5):
            want = off(x[:m])
            assert torch.equal(on(x[:m]), want), (isa, m)
            assert torch.equal(call_product(call, x[:m], n, 2), want), (isa, m)


def test_rows_copied_once_and_kept_while_held(kernel, huge, monkeypatch):
    """One copy per weight while a product holds it; the cache alone does not keep it."""
    import gc
    import weakref

    monkeypatch.setenv("LMPLUG_GGUF_ISA", row_sets(kernel, monkeypatch, "IQ4_NL")[0])
    k = 256
    w = torch.from_numpy(make_weight("IQ4_NL", 20, k, seed=6))
    first = gguf_native.BoundProduct(kernel, w, type_id("IQ4_NL"), k)
    assert gguf_native.BoundProduct(kernel, w, type_id("IQ4_NL"), k).w is first.w
    gone = weakref.ref(first.w)
    del first
    gc.collect()
    assert gone() is None


def test_a_private_copy_is_forgotten_for_the_rows_in_huge_pages(kernel, huge, monkeypatch):
    """Rows in this process's own memory (a copy made at load) are dropped by the cache once the
    copy in huge pages exists (``panels_only``): the bound product holds the one copy."""
    import gc
    import weakref

    monkeypatch.setenv("LMPLUG_GGUF_ISA", row_sets(kernel, monkeypatch, "IQ4_NL")[0])
    k = 256
    w = torch.from_numpy(make_weight("IQ4_NL", 24, k, seed=7).copy())
    want = w.clone()
    bound = gguf_native.BoundProduct(kernel, w, type_id("IQ4_NL"), k)
    assert kernel.panels_only(w, type_id("IQ4_NL"), k)
    assert not kernel.panels_only(w, type_id("IQ4_NL"), k)
    gone = weakref.ref(w)
    del w
    gc.collect()
    assert gone() is None and torch.equal(bound.w, want)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_rows_of_a_file_mapping_are_released_once_copied(kernel, huge, monkeypatch, tmp_path):
    monkeypatch.setenv("LMPLUG_GGUF_ISA", row_sets(kernel, monkeypatch, "IQ4_NL")[0])
    k, n = 256, 4096
    w = make_weight("IQ4_NL", n, k, seed=2)
    mapped = file_rows(tmp_path / "rows.bin", w)
    assert torch.equal(mapped, torch.from_numpy(w))
    lo, hi = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    assert resident_kib(lo, hi) >= 500
    bound = gguf_native.BoundProduct(kernel, mapped, type_id("IQ4_NL"), k)
    assert resident_kib(lo, hi) <= 8
    assert bound.w.lmplug_rows_in_file and torch.equal(bound.w, torch.from_numpy(w))
    assert not kernel.panels_only(mapped, type_id("IQ4_NL"), k)  # the file's rows stay as they are
