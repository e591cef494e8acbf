"""Tree masks in the native C decode kernel (paged_native.py, csrc/paged_decode_cpu.c): rows of a
speculative draft tree attend to the cached prefix and their ancestors-or-self among the query
tokens. Checked against float64 math over exactly each row's attended slots, and bit for bit
against plain rows of the same kernel over a cache with those K/V rows at consecutive positions
(what the engine has after moving accepted nodes' K/V), with NaN in every slot a row must not read."""

from __future__ import annotations

import pytest
import torch
from support.paged_cases import float64_attention, paged_batch

BLOCK = 4


def random_tree(n: int, g: torch.Generator) -> list[int]:
    """Ancestor-or-self bit masks of a random tree of n + 1 nodes in topological order (node 0 the
    root, node j's parent drawn from [0, j))."""
    masks = [1]
    for j in range(1, n + 1):
        parent = int(torch.randint(0, j, (1,), generator=g))
        masks.append(masks[parent] | 1 << j)
    return masks


def as_int64(bits: int) -> int:
    """uint64 bits as the int64 the Python API takes (bit 63: the sign bit)."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def tree_batch(trees, num_heads, num_kv_heads, head_dim, dtype, seed=0, poison=False, plain=0):
    """Sequences (cached c, draft nodes n) verified as trees, one decode row per query token over the
    sequence's block table: row j has mask_start c and its ancestor bits, and seq_len c + n + 1 or
    (odd sequences) c + j + 1, the two ways a caller may cut it. ``plain`` extra rows per sequence
    have no mask (mask_start -1, random bits that must be ignored) and a random length.
    Returns q, caches, row tables, row lengths, mask_starts, masks and each row's list of attended
    positions (before any window)."""
    g = torch.Generator().manual_seed(seed + 100)
    lens = [c + n + 1 for c, n in trees]
    _, kc, vc, tables, _ = paged_batch(lens, num_heads, num_kv_heads, head_dim, BLOCK, dtype, seed, poison)
    owners, row_lens, starts, bits, lists = [], [], [], [], []
    for i, (c, n) in enumerate(trees):
        for j, anc in enumerate(random_tree(n, g)):
            owners.append(i)
            row_lens.append(c + n + 1 if i % 2 == 0 else c + j + 1)
            starts.append(c)
            bits.append(as_int64(anc))
            lists.append(list(range(c)) + [c + k for k in range(n + 1) if anc >> k & 1])
        for _ in range(plain):
            m = int(torch.randint(1, c + n + 2, (1,), generator=g))
            owners.append(i)
            row_lens.append(m)
            starts.append(-1)
            bits.append(int(torch.randint(-2**62, 2**62, (1,), generator=g)))
            lists.append(list(range(m)))
    q = torch.randn(len(owners), num_heads, head_dim, generator=g).to(dtype)
    return (q, kc, vc, tables[owners], torch.tensor(row_lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), torch.tensor(bits, dtype=torch.int64), lists)


def windowed(lists, window):
    return [lst[-window:] if window else lst for lst in lists]


def float64_lists(q, k_cache, v_cache, tables, lists, scale):
    """float64 attention of each row over exactly the positions of its list."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, lst in enumerate(lists):
        # the positions as a contiguous sequence of their own: row r's table, its list's slots
        block_size = k_cache.shape[1]
        slots = torch.tensor([int(tables[r, p // block_size]) * block_size + p % block_size for p in lst])
        flat_k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].unsqueeze(1)  # [S, 1, Hkv, D]
        flat_v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].unsqueeze(1)
        table = torch.arange(len(lst), dtype=torch.int32).unsqueeze(0)
        out[r] = float64_attention(q[r:r + 1], flat_k, flat_v, table, torch.tensor([len(lst)]), scale)[0]
    return out


def contiguous_cache(k_cache, v_cache, tables, lists, block_size, seed=0):
    """A second cache where row r's attended K/V rows sit at positions 0 .. len(list) - 1 of its own
    blocks (scattered over the pool): its tables and lengths, for plain rows of the kernel."""
    blocks = [max(1, -(-len(lst) // block_size)) for lst in lists]
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(seed + 7))
    shape = (sum(blocks), block_size, *k_cache.shape[2:])
    k2 = torch.full(shape, float("nan"), dtype=k_cache.dtype)
    v2 = torch.full(shape, float("nan"), dtype=v_cache.dtype)
    new_tables = torch.zeros(len(lists), max(blocks), dtype=torch.int32)
    src, dst, start = [], [], 0
    for r, (lst, nb) in enumerate(zip(lists, blocks)):
        new_tables[r, :nb] = order[start:start + nb]
        start += nb
        for i, p in enumerate(lst):
            src.append(int(tables[r, p // block_size]) * block_size + p % block_size)
            dst.append(int(new_tables[r, i // block_size]) * block_size + i % block_size)
    for old, new in ((k_cache, k2), (v_cache, v2)):
        new.view(-1, *shape[2:])[dst] = old.reshape(-1, *shape[2:])[src]
    return k2, v2, new_tables, torch.tensor([len(lst) for lst in lists], dtype=torch.int32)


TREES = [(0, 5), (37, 63), (3, 1), (130, 20), (9, 0), (64, 31)]  # (cached, draft nodes)
SHAPES = [(9, 3, 64), (8, 2, 128), (4, 1, 80), (6, 2, 40)]  # 40: the portable (non AVX-512) loops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("window", [None, 1, 30, 90])
def test_masked_rows_match_float64(native, dtype, num_heads, num_kv_heads, head_dim, window):
    q, kc, vc, tables, lens, starts, masks, lists = tree_batch(TREES, num_heads, num_kv_heads, head_dim,
                                                                dtype, seed=1, plain=1)
    scale = head_dim ** -0.5
    got = native.paged_decode_attention(q, kc, vc, tables, lens, scale, sliding_window=window,
                                        mask_starts=starts, masks=masks)
    exact = float64_lists(q, kc, vc, tables, windowed(lists, window), scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    else:  # float32 math, one rounding: within half an ulp (+ float32 noise)
        err = (got.double() - exact).abs()
        assert (err <= 2.0 ** -8 * exact.abs() + 1e-5).all(), float(err.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("window", [None, 1, 30, 90])
def test_masked_rows_equal_plain_rows_over_contiguous_kv(native, dtype, num_heads, num_kv_heads, head_dim,
                                                         window):
    """Bit for bit: the kernel's result for a masked row is its result for a plain row whose cache holds
    the same K/V rows at consecutive positions (after the engine compacts accepted nodes)."""
    q, kc, vc, tables, lens, starts, masks, lists = tree_batch(TREES, num_heads, num_kv_heads, head_dim,
                                                                dtype, seed=2, plain=1)
    masked = native.paged_decode_attention(q, kc, vc, tables, lens, 0.1, sliding_window=window,
                                           mask_starts=starts, masks=masks)
    k2, v2, tables2, lens2 = contiguous_cache(kc, vc, tables, lists, BLOCK, seed=2)
    plain = native.paged_decode_attention(q, k2, v2, tables2, lens2, 0.1, sliding_window=window)
    assert torch.isfinite(masked).all()
    assert torch.equal(masked, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_rows_in_a_masked_batch_are_unchanged(native, dtype):
    """Rows with mask_start -1 (whatever their bits) give what a call without masks gives, and a mask
    with every bit of [mask_start, seq_len) set is the plain row, bit for bit."""
    q, kc, vc, tables, lens, starts, masks, _ = tree_batch(TREES, 9, 3, 64, dtype, seed=3, plain=3)
    plain_rows = starts < 0
    assert 0 < int(plain_rows.sum()) < len(starts)
    for window in (None, 17):
        without = native.paged_decode_attention(q, kc, vc, tables, lens, 0.1, sliding_window=window)
        mixed = native.paged_decode_attention(q, kc, vc, tables, lens, 0.1, sliding_window=window,
                                              mask_starts=starts, masks=masks)
        assert torch.equal(mixed[plain_rows], without[plain_rows])
        assert not torch.equal(mixed[~plain_rows], without[~plain_rows])  # the masks did something
        # every bit of the span set (and bits past it, which must be ignored): the plain row
        full_starts = torch.clamp(lens - torch.randint(0, 65, lens.shape, generator=torch.Generator()
                                                       .manual_seed(0), dtype=torch.int32), min=0)
        full = native.paged_decode_attention(q, kc, vc, tables, lens, 0.1, sliding_window=window,
                                             mask_starts=full_starts, masks=torch.full_like(masks, -1))
        assert torch.equal(full, without)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3, 40])
def test_unattended_slots_never_leak(native, dtype, window):
    """Each row on blocks of its own, NaN in every slot it must not read: past its length, masked-out
    tree nodes, before its window. The output is finite and equals the clean cache's."""
    trees = [(5, 10), (0, 63), (40, 7), (77, 30)]
    q, _, _, _, lens, starts, masks, lists = tree_batch(trees, 9, 3, 64, dtype, seed=4)
    # one sequence per row: the same lengths and tables layout, so poisoning is per row
    rows = len(lens)
    _, kc_own, vc_own, tables_own, _ = paged_batch(lens.tolist(), 9, 3, 64, BLOCK, dtype, seed=5)
    read = torch.zeros(kc_own.shape[:2], dtype=torch.bool)
    for r, lst in enumerate(windowed(lists, window)):
        for p in lst:
            read[tables_own[r, p // BLOCK], p % BLOCK] = True
    kc_nan, vc_nan = kc_own.clone(), vc_own.clone()
    kc_nan[~read] = float("nan")
    vc_nan[~read] = float("nan")
    assert (lens > torch.tensor([len(lst) for lst in lists])).any()  # masked-out nodes are poisoned
    args = {"sliding_window": window, "mask_starts": starts, "masks": masks}
    clean = native.paged_decode_attention(q, kc_own, vc_own, tables_own, lens, 0.1, **args)
    poisoned = native.paged_decode_attention(q, kc_nan, vc_nan, tables_own, lens, 0.1, **args)
    assert rows == poisoned.shape[0] and torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("threads", [2, 3])
def test_masked_rows_independent_of_threads(native, threads):
    q, kc, vc, tables, lens, starts, masks, _ = tree_batch(TREES, 9, 3, 64, torch.bfloat16, seed=6, plain=1)
    args = {"mask_starts": starts, "masks": masks}
    one = native.paged_decode_attention(q, kc, vc, tables, lens, 0.1, num_threads=1, **args)
    many = native.paged_decode_attention(q, kc, vc, tables, lens, 0.1, num_threads=threads, **args)
    assert torch.equal(one, many)
    alone = native.paged_decode_attention(q[5:6], kc, vc, tables[5:6], lens[5:6], 0.1,  # and of the batch
                                          mask_starts=starts[5:6], masks=masks[5:6])
    assert torch.equal(alone[0], one[5])


def test_masks_through_prepare_and_decode(native):
    """``prepare`` carries checked masks to every layer's ``decode``."""
    q, kc, vc, tables, lens, starts, masks, _ = tree_batch(TREES, 4, 2, 64, torch.float32, seed=8)
    want = native.paged_decode_attention(q, kc, vc, tables, lens, 0.1, mask_starts=starts, masks=masks)
    kernel = native.load()
    batch = native.prepare(tables, lens, BLOCK, kc.shape[0], mask_starts=starts, masks=masks)
    assert torch.equal(kernel.decode(q, kc, vc, batch, 0.1, None, torch.empty_like(q)), want)
    plain = native.prepare(tables, lens, BLOCK, kc.shape[0])
    assert not torch.equal(kernel.decode(q, kc, vc, plain, 0.1, None, torch.empty_like(q)), want)
    with pytest.raises(ValueError, match="masks given without mask_starts"):
        native.prepare(tables, lens, BLOCK, kc.shape[0], masks=masks)


def test_bad_masks_are_clear_errors(native):
    q, kc, vc, tables, lens, starts, masks, _ = tree_batch([(10, 4), (100, 2)], 4, 2, 64, torch.float32)
    call = native.paged_decode_attention
    with pytest.raises(ValueError, match="mask_starts given without masks"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=starts)
    with pytest.raises(ValueError, match="masks given without mask_starts"):
        call(q, kc, vc, tables, lens, 0.1, masks=masks)
    with pytest.raises(ValueError, match=r"mask_starts must be a torch.int32 .*got torch.int64"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=starts.long(), masks=masks)
    with pytest.raises(ValueError, match=r"masks must be a torch.int64 .*got torch.int32"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=starts, masks=masks.int())
    with pytest.raises(ValueError, match=r"masks must be .*shape \[B\] = \(8,\), got .*\(7,\)"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=starts, masks=masks[1:])
    with pytest.raises(ValueError, match=r"mask_starts must be .*got .*\(8, 1\)"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=starts[:, None], masks=masks)
    with pytest.raises(ValueError, match=r"mask_starts must be .*got list"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=starts.tolist(), masks=masks)
    too_far = starts.clone()
    too_far[6] = int(lens[6]) - 65  # a span of 65 positions: more than one uint64 covers
    with pytest.raises(ValueError, match=r"mask_starts must lie in \[seq_lens - 64, seq_lens\].*rows \[6\]"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=too_far, masks=masks)
    past = starts.clone()
    past[0] = int(lens[0]) + 1  # starts past the row's length
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        call(q, kc, vc, tables, lens, 0.1, mask_starts=past, masks=masks)
    # the edges are fine: a span of exactly 64, an empty span, and -1 (no mask) anywhere
    edges = starts.clone()
    edges[6], edges[0], edges[1] = int(lens[6]) - 64, int(lens[0]), -1
    got = call(q, kc, vc, tables, lens, 0.1, mask_starts=edges, masks=masks)
    assert torch.isfinite(got).all()
