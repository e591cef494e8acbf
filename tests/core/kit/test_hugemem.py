"""``lmplug.kit.hugemem``: pieces cut from arenas of transparent huge pages, checked against what
Linux reports of this process's mappings (/proc/self/maps, /proc/self/smaps): alignment, pieces
inside their arena and apart, big pieces on mappings of their own, arenas unmapped once their
pieces are gone, ``LMPLUG_HUGE_PAGES=0``, and huge pages really granted where the kernel offers them."""

from __future__ import annotations

import gc
import itertools
import sys

import pytest
import torch

from lmplug.kit import hugemem

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings and /proc are Linux's")


@pytest.fixture
def fresh(monkeypatch):
    """Huge pages on, and the next piece starts a new arena (no pieces left by other tests)."""
    monkeypatch.delenv("LMPLUG_HUGE_PAGES", raising=False)
    if not hugemem.enabled():
        pytest.skip(f"hugemem is torch.empty here (not Linux, no MADV_HUGEPAGE, or transparent huge pages "
                    f"{hugemem.thp_mode()!r})")
    monkeypatch.setattr(hugemem, "_arena", [None, 0])


def _arena(piece: torch.Tensor) -> tuple[int, int]:
    """(start, end) of the mapping ``piece`` was cut from: its storage (/proc/self/maps may show
    neighbouring anonymous mappings merged into one line)."""
    storage = piece.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _mapping(addr: int) -> tuple[int, int] | None:
    """The (start, end) of the mapping of /proc/self/maps that holds ``addr``, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            if lo <= addr < hi:
                return lo, hi
    return None


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux
def test_pieces_are_aligned_inside_their_arena_and_apart(fresh):
    sizes = [1, 63, 64, 65, 4096, 100_000, 3, 2 << 20, 777, 5 << 20]
    pieces = [hugemem.empty(n) for n in sizes]
    arena = _arena(pieces[0])
    assert _mapping(arena[0]) is not None and _mapping(arena[1] - 1) is not None
    assert pieces[0].data_ptr() % hugemem.HUGE_PAGE == 0  # an arena starts on a huge page
    spans = []
    for piece, n in zip(pieces, sizes):
        start = piece.data_ptr()
        assert piece.dtype == torch.uint8 and piece.numel() == n and piece.is_contiguous()
        assert start % hugemem.ALIGN == 0
        assert _arena(piece) == arena and arena[0] <= start and start + n <= arena[1]  # one arena: all fit
        spans.append((start, start + n))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    for i, piece in enumerate(pieces):  # writes to one piece leave the others as they were
        piece.fill_(i)
    assert all(bool((piece == i).all()) for i, piece in enumerate(pieces))


@linux
def test_an_arena_first_cut_inside_a_forward_serves_writes_outside_it(fresh):
    """Weights are often bound lazily, in the first forward (under ``torch.inference_mode``):
    the arena made then must not be an inference tensor, or a later copy outside one fails."""
    with torch.inference_mode():
        inside = hugemem.empty(1000)
    outside = hugemem.empty(1000)  # cut from the same arena
    assert _arena(inside) == _arena(outside)
    assert not inside.is_inference() and not outside.is_inference()
    outside.copy_(torch.full((1000,), 3, dtype=torch.uint8))
    inside.fill_(4)
    assert int(outside.sum()) == 3000 and int(inside.sum()) == 4000


@linux
def test_a_full_arena_gives_way_to_a_new_one(fresh, monkeypatch):
    monkeypatch.setattr(hugemem, "ARENA_BYTES", 4 << 20)
    first = hugemem.empty(3 << 20)
    second = hugemem.empty(2 << 20)  # does not fit in the rest of the first arena
    assert _arena(first) != _arena(second)
    assert second.data_ptr() % hugemem.HUGE_PAGE == 0
    third = hugemem.empty(100)  # cut from the second, the current one
    assert third.data_ptr() == second.data_ptr() + (2 << 20)


@linux
def test_big_pieces_get_mappings_of_their_own(fresh, monkeypatch):
    monkeypatch.setattr(hugemem, "ARENA_BYTES", 4 << 20)
    small = hugemem.empty(1000)
    big = hugemem.empty((9 << 20) + 5)
    assert big.numel() == (9 << 20) + 5 and big.data_ptr() % hugemem.HUGE_PAGE == 0
    lo, hi = _arena(big)
    assert lo <= big.data_ptr() and big.data_ptr() + big.numel() <= hi and _arena(small) != (lo, hi)
    assert hi - lo <= big.numel() + 2 * hugemem.HUGE_PAGE  # its size in huge pages, plus the alignment
    after = hugemem.empty(1000)  # the small pieces' arena goes on
    assert after.data_ptr() == small.data_ptr() + 1024
    big.fill_(7)
    assert int(big[-1]) == 7 and int(big.sum()) == 7 * big.numel()


@linux
def test_an_arena_is_unmapped_once_its_pieces_are_gone(fresh, monkeypatch):
    monkeypatch.setattr(hugemem, "ARENA_BYTES", 4 << 20)
    pieces = [hugemem.empty(1 << 20), hugemem.empty(1000)]
    view = pieces[1][10:20]  # a view of a piece holds the arena too
    addr = pieces[0].data_ptr()
    hugemem.empty(3 << 20)  # no room left: a new current arena
    assert _mapping(addr) is not None
    del pieces
    gc.collect()
    assert _mapping(addr) is not None and int(view.sum()) >= 0
    del view
    gc.collect()
    assert _mapping(addr) is None
    big = hugemem.empty(8 << 20)
    addr = big.data_ptr()
    del big
    gc.collect()
    assert _mapping(addr) is None


def test_huge_pages_off_gives_torch_empty(monkeypatch):
    monkeypatch.setenv("LMPLUG_HUGE_PAGES", "0")
    monkeypatch.setattr(hugemem, "_arena", [None, 0])
    assert not hugemem.enabled()
    piece = hugemem.empty(3 << 20)
    assert piece.dtype == torch.uint8 and piece.numel() == 3 << 20
    assert piece.untyped_storage().nbytes() == 3 << 20  # a tensor of its own, no arena
    assert hugemem._arena == [None, 0]
    assert hugemem.empty(0).numel() == 0


@linux
def test_no_huge_pages_where_linux_gives_none(monkeypatch):
    """Transparent huge pages ``never`` (or absent): ``empty`` is ``torch.empty``, nothing to gain."""
    monkeypatch.delenv("LMPLUG_HUGE_PAGES", raising=False)
    monkeypatch.setattr(hugemem, "_arena", [None, 0])
    for mode in ("never", None):
        monkeypatch.setattr(hugemem, "thp_mode", lambda mode=mode: mode)
        assert not hugemem.enabled()
        assert hugemem.empty(1 << 20).untyped_storage().nbytes() == 1 << 20
    monkeypatch.setattr(hugemem, "thp_mode", lambda: "madvise")
    assert hugemem.enabled() == hasattr(__import__("mmap"), "MADV_HUGEPAGE")


@linux
def test_huge_pages_are_granted(fresh):
    """Where transparent huge pages are not ``never``, a touched 4 MiB piece at an arena's start
    lies in huge pages (AnonHugePages of its mapping and of the process)."""
    mode = hugemem.thp_mode()
    if mode is None:
        pytest.skip("no /sys/kernel/mm/transparent_hugepage: this kernel has no transparent huge pages")
    if mode == "never":
        pytest.skip("transparent huge pages are [never] on this machine")
    before = hugemem.huge_bytes()
    piece = hugemem.empty(4 << 20)
    piece.fill_(1)
    assert _anon_huge_kib(piece.data_ptr()) >= 2048, f"no huge page granted (THP {mode})"
    assert hugemem.huge_bytes() >= before + (2 << 20)
