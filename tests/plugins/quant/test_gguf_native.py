"""The native GGUF CPU kernels (gguf_native.py, csrc/gguf_cpu.c) against an exact PyTorch
simulation of their math, against gguf-py's dequantize + a float matmul, across thread counts
and kernel sets, and without a compiler.

Weights: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 quantized by gguf-py from random floats; the k-quants random
bytes with sane fp16 scales (every bit pattern of their quants and 6-bit scales is valid).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from support.gguf_weights import f16, make_weight, quantize_acts, type_id

from lmplug.kit.native_build import NativeBuildError

gguf_native = pytest.importorskip("lmplug_quant.gguf_native")

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
MS = [1, 3, 8, 33]
N, K = 37, 512  # N odd (not a multiple of the 16-row tiles), K a multiple of 256


def dequantized(name: str, w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w, GGMLQuantizationType(type_id(name))).copy())


# ---------------------------------------------------------------- the exact simulation

def k_scales(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 6-bit scales and 8 mins (ggml's get_scale_min_k4)."""
    p = p.long()
    d, m, md = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], -1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], -1)
    return sc, mn


def integer_weights(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                        torch.Tensor | None]:
    """Per block: integer weights W [N, nb, elems] (scales folded in), the integer weights of the
    offset term Wm (or None), and the float scales A, B [N, nb] with
    block term = A * dx * (W . qx) + B * dx * (Wm . qx)."""
    t = type_id(name)
    size = gguf_native.BLOCKS[t][1]
    b = w.reshape(w.shape[0], -1, size)
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        at = 4 if name.endswith("_1") else 2  # the nibbles (Q4) or qh then the nibbles (Q5)
        qs = b[..., at + 4 * name.startswith("Q5"):].long()
        q = torch.cat([qs & 15, qs >> 4], -1)
        if name.startswith("Q5"):  # bit e of the little-endian 32-bit qh: bit 4 of value e
            qh = b[..., at:at + 4].long()
            qh = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
            q = q | ((qh[..., None] >> torch.arange(32)) & 1) << 4
        if name.endswith("_0"):
            return q - (16 if name == "Q5_0" else 8), None, f16(b[..., 0:2]), None
        return q, torch.ones_like(q), f16(b[..., 0:2]), f16(b[..., 2:4])
    if name == "Q8_0":
        return b[..., 2:].contiguous().view(torch.int8).long(), None, f16(b[..., 0:2]), None
    if name in ("Q4_K", "Q5_K"):
        sc, mn = k_scales(b[..., 4:16])
        qs = b[..., 48 if name == "Q5_K" else 16:][..., :128].long().reshape(*b.shape[:2], 4, 32)
        q = torch.stack([qs & 15, qs >> 4], 3).reshape(*b.shape[:2], 8, 32)
        if name == "Q5_K":
            qh = b[..., 16:48].long()
            q = q | torch.stack([((qh >> s) & 1) << 4 for s in range(8)], 2)
        per = lambda v: v[..., None].expand(*v.shape, 32)
        return ((per(sc) * q).reshape(*b.shape[:2], 256), per(mn).reshape(*b.shape[:2], 256),
                f16(b[..., 0:2]), -f16(b[..., 2:4]))
    if name == "Q3_K":  # 16 6-bit scales - 32; value e: 2 bits of qs, bit 2 from hmask, minus 4
        p = b[..., 96:108].long()
        low = torch.cat([p[..., :8] & 15, p[..., :8] >> 4], -1)
        high = torch.stack([(p[..., 8:12] >> (2 * g)) & 3 for g in range(4)], -2).reshape(*b.shape[:2], 16)
        sc = (low | high << 4) - 32
        hm, qs = b[..., :32].long(), b[..., 32:96].long()
        q = torch.stack([((qs[..., 32 * n:32 * n + 32] >> (2 * j)) & 3) | (((hm >> (4 * n + j)) & 1) << 2)
                         for n in range(2) for j in range(4)], 2).reshape(*b.shape[:2], 256) - 4
        scale = sc[..., None].expand(*sc.shape, 16).reshape(*b.shape[:2], 256)
        return scale * q, None, f16(b[..., 108:110]), None
    # Q6_K
    ql, qh = b[..., :128].long(), b[..., 128:192].long()
    sc = b[..., 192:208].contiguous().view(torch.int8).long()
    halves = []
    for h in range(2):
        for t in range(4):
            low = (ql[..., 64 * h + 32 * (t & 1):][..., :32] >> (4 * (t >> 1))) & 15
            high = (qh[..., 32 * h:32 * h + 32] >> (2 * t)) & 3
            halves.append(low | (high << 4))
    q = torch.stack(halves, 2).reshape(*b.shape[:2], 256) - 32
    scale = sc[..., None].expand(*sc.shape, 16).reshape(*b.shape[:2], 256)
    return scale * q, None, f16(b[..., 208:210]), None


def simulate(name: str, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's result in float64 from its integer dot products, and the sum of |products|
    (the scale of the float32 rounding the kernel adds: products, sums in its order)."""
    elems = gguf_native.BLOCKS[type_id(name)][0]
    qx, dx = quantize_acts(x, elems)
    wi, wm, a, bm = integer_weights(name, w)
    dots = torch.einsum("mbe,nbe->mnb", qx, wi.double())
    scale = (a[None] * dx[:, None]).double()  # [M, N, nb]: (d_w * d_x) rounded to float32, as in C
    terms = scale * dots
    # the largest any partial sum can be: SIMD lanes hold parts of a block's dot product
    size = scale.abs() * torch.einsum("mbe,nbe->mnb", qx.abs(), wi.double().abs())
    if wm is not None:  # the offset term, separately rounded (the two may cancel)
        scale = (bm[None] * dx[:, None]).double()
        terms = terms + scale * torch.einsum("mbe,nbe->mnb", qx, wm.double())
        size = size + scale.abs() * torch.einsum("mbe,nbe->mnb", qx.abs(), wm.double().abs())
    return terms.sum(-1), size.sum(-1)


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", TYPES)
def test_matches_exact_simulation(kernel, name, m):
    w = torch.from_numpy(make_weight(name, N, K))
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    got = kernel.mul_mat(x, w, type_id(name), K)
    want, scale = simulate(name, x, w)
    assert got.dtype == torch.float32 and got.shape == (m, N)
    # float32 sums in another order: a few float32 ulps (6e-8) of the sum of |products| (3e-8 measured)
    assert ((got.double() - want).abs() <= 3e-7 * scale + 1e-30).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", TYPES)
def test_close_to_gguf_dequantize_matmul(kernel, name, m):
    w = make_weight(name, N, K, seed=1)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(10 + m))
    want = x.double() @ dequantized(name, w).double().T
    got = torch.ops.lmplug_quant.gguf_mul_mat(x, torch.from_numpy(w), type_id(name), K)
    # 8-bit activations (one scale per 32 or 256 values): about 0.5-0.9 % relative error measured
    assert (got.double() - want).norm() / want.norm() < 0.02


@pytest.mark.parametrize("name", TYPES)
def test_threads_give_identical_bits(kernel, name):
    n, k, m = 301, 1024, 9
    assert kernel.threads_used(m, k, n, 2) == 2  # the shape is big enough to split
    w = torch.from_numpy(make_weight(name, n, k, seed=2))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    one = kernel.mul_mat(x, w, type_id(name), k, num_threads=1)
    two = kernel.mul_mat(x, w, type_id(name), k, num_threads=2)
    assert torch.equal(one, two)
    # and a row's result does not depend on the other rows of the batch (groups of 8, 1, 3 rows)
    assert torch.equal(kernel.mul_mat(x[8:9], w, type_id(name), k, num_threads=1), one[8:9])
    assert torch.equal(kernel.mul_mat(x[4:5], w, type_id(name), k, num_threads=1), one[4:5])
    assert torch.equal(kernel.mul_mat(x[2:5], w, type_id(name), k, num_threads=1), one[2:5])


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 6, 7, 18])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_block_counts_not_a_multiple_of_four(kernel, monkeypatch, name, blocks):
    """The SIMD kernels take the 32-blocks 4 at a time: rows of 1-3 blocks past a multiple of 4
    (576 = 18 blocks is the demo model's width) match the simulation, in both kernel sets, and a
    row gives the same bits in a batch of 9 (groups of 8 and 1), alone and with 2 threads."""
    k, n = 32 * blocks, 67
    w = torch.from_numpy(make_weight(name, n, k, seed=blocks))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(blocks))
    want, scale = simulate(name, x, w)
    batch = kernel.mul_mat(x, w, type_id(name), k, num_threads=2)
    assert ((batch.double() - want).abs() <= 3e-7 * scale + 1e-30).all()
    for m in (0, 5, 8):
        assert torch.equal(kernel.mul_mat(x[m:m + 1], w, type_id(name), k, num_threads=1), batch[m:m + 1])
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
    portable = kernel.mul_mat(x, w, type_id(name), k)
    assert ((portable.double() - want).abs() <= 3e-7 * scale + 1e-30).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_largest_products_do_not_overflow(kernel, name):
    """The SIMD kernels add 4- and 5-bit weights' products in int16 before int32 (sums of 8: at
    most 8 * 31 * 127). Blocks of the largest weights (Q4_0 all -8, Q4_1 all 15, Q5_0 all -16,
    Q5_1 all 31, Q8_0 -128 and 127) times activations of the largest magnitude, signs matched so
    no product cancels, must still match the exact simulation, for 1, 8 and 9 rows (the 8-row
    groups and a lone row)."""
    k, n, t = 32 * 7, 19, type_id(name)
    elems, size = gguf_native.BLOCKS[t]
    blocks = np.zeros((n, k // elems, size), dtype=np.uint8)
    blocks[..., 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if name in ("Q4_1", "Q5_1"):
        blocks[..., 2:4] = np.array([0.5], dtype=np.float16).view(np.uint8)
        blocks[..., 4:] = 0xFF  # every nibble 15 (and every 5th bit set: 31)
        sign = torch.ones(k)
    elif name in ("Q4_0", "Q5_0"):
        blocks[..., 2:] = 0x00  # every nibble 0 (and 5th bit clear): the value -8 (-16)
        sign = -torch.ones(k)
    else:  # Q8_0: -128 in the first half of each block, 127 in the second
        blocks[..., 2:18], blocks[..., 18:] = 0x80, 0x7F
        sign = torch.tensor([-1.0] * 16 + [1.0] * 16).repeat(k // 32)
    w = torch.from_numpy(blocks.reshape(n, -1))
    for m in (1, 8, 9):
        x = sign.repeat(m, 1) * torch.linspace(1, 2, m)[:, None]
        want, scale = simulate(name, x, w)
        got = kernel.mul_mat(x, w, t, k, num_threads=1)
        assert ((got.double() - want).abs() <= 3e-7 * scale + 1e-30).all(), (got.double() - want).abs().max()
        assert (quantize_acts(x, elems)[0].abs() == 127).all()  # the products are as large as planned


@pytest.mark.parametrize("isa", ["generic", "auto"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_activation_ties_round_to_even(kernel, monkeypatch, name, isa):
    """Activations exactly halfway between two steps (amax 127: step 1, values n + 1/2) round to
    the even neighbour, as the simulation's torch.round does, in both kernel sets."""
    k = 256
    x = torch.arange(k, dtype=torch.float32).remainder(21).sub(10).add(0.5)  # -9.5 .. 10.5
    x[::32] = 127.0  # every block's amax: d = 1, 1 / d = 1
    x = torch.stack([x, -x])
    w = torch.from_numpy(make_weight(name, 5, k, seed=7))
    monkeypatch.setenv("LMPLUG_GGUF_ISA", isa)
    got = kernel.mul_mat(x, w, type_id(name), k)
    want, scale = simulate(name, x, w)
    assert ((got.double() - want).abs() <= 3e-7 * scale + 1e-30).all()
    # rounding the halves away from zero instead moves the result by far more than the tolerance
    away, _ = simulate(name, x + torch.sign(x) * 1e-3 * (x.abs() != 127), w)
    assert ((away - want).abs() > 1e-3 * scale).any()


def test_concurrent_calls_share_the_pool_correctly(kernel):
    """Two Python threads at once (ctypes releases the GIL: one gets the worker pool, the other
    runs alone while it is busy), both bit-identical to one thread."""
    n, k = 576, 576  # a decode GEMV of the demo model: worth 2 threads at batch 1
    assert kernel.threads_used(1, k, n, 2) == 2
    w = torch.from_numpy(make_weight("Q8_0", n, k, seed=5))
    xs = [torch.randn(1, k, generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
    want = [kernel.mul_mat(x, w, 8, k, num_threads=1) for x in xs]
    mismatches, start = [], threading.Barrier(2)

    def calls(i: int) -> None:
        start.wait()
        for _ in range(200):
            if not torch.equal(kernel.mul_mat(xs[i], w, 8, k, num_threads=2), want[i]):
                mismatches.append(i)

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and mismatches == []


def _child_product(kernel, x, w, k, queue) -> None:
    before = kernel.pool_workers()
    out = kernel.mul_mat(x, w, 8, k, num_threads=2).numpy().tobytes()
    queue.put((before, kernel.pool_workers(), out))


def test_forked_child_recreates_the_pool(kernel):
    """The parent's workers do not exist after fork(): the child must start its own, not wait
    for them."""
    n, k = 301, 1024
    w = torch.from_numpy(make_weight("Q8_0", n, k, seed=6))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    want = kernel.mul_mat(x, w, 8, k, num_threads=2)
    assert kernel.pool_workers() >= 1  # the parent's pool is started
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_product, args=(kernel, x, w, k, queue))
    child.start()
    try:
        before, after, got = queue.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert (before, after) == (0, 1)  # the child forgot the parent's workers and started its own
    assert got == want.numpy().tobytes()
    assert torch.equal(kernel.mul_mat(x, w, 8, k, num_threads=2), want)  # and the parent's still works


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "avx512"])
@pytest.mark.parametrize("name", TYPES)
def test_portable_kernels_match_simd(kernel, name, monkeypatch, isa):
    if gguf_native.ISAS.index(kernel.best_isa) < gguf_native.ISAS.index(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernels: {gguf_native.describe_isa(kernel.best_isa)}")
    w = torch.from_numpy(make_weight(name, N, K, seed=3))
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv("LMPLUG_GGUF_ISA", isa)
    simd = kernel.mul_mat(x, w, type_id(name), K)
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
    portable = kernel.mul_mat(x, w, type_id(name), K)
    assert torch.equal(simd, portable)  # every set: the same integers and float operations in order


@pytest.mark.parametrize("isa", ["generic", "avx2", "avxvnni", "avx512"])
@pytest.mark.parametrize("name", TYPES)
def test_each_row_count_gives_the_rows_bits(kernel, name, monkeypatch, isa):
    """Every row count up to two 8-row groups (a verify's k + 1 rows: each count has a kernel of
    its own) gives each row the bits that row gets in a 33-row product: a row's operations do not
    depend on the rows beside it."""
    if gguf_native.ISAS.index(kernel.best_isa) < gguf_native.ISAS.index(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernels: {gguf_native.describe_isa(kernel.best_isa)}")
    w = torch.from_numpy(make_weight(name, N, K, seed=5))
    x = torch.randn(33, K, generator=torch.Generator().manual_seed(5)) * 2
    monkeypatch.setenv("LMPLUG_GGUF_ISA", isa)
    whole = kernel.mul_mat(x, w, type_id(name), K, num_threads=1)
    for m in range(1, 17):
        for start in (0, 33 - m):
            got = kernel.mul_mat(x[start:start + m], w, type_id(name), K, num_threads=1)
            assert torch.equal(got, whole[start:start + m]), (m, start)


def test_weight_views_and_other_activation_dtypes(kernel):
    """Rows of a larger buffer (as from an mmap: row stride > row bytes) and bfloat16 x."""
    w = torch.from_numpy(make_weight("Q8_0", 12, 256, seed=4))
    padded = torch.zeros(12, w.shape[1] + 7, dtype=torch.uint8)
    padded[:, 3:3 + w.shape[1]] = w
    x = torch.randn(2, 256).bfloat16()
    view = padded[:, 3:3 + w.shape[1]]
    assert torch.equal(kernel.mul_mat(x, view, 8, 256), kernel.mul_mat(x.float(), w, 8, 256))


def test_bad_input_is_named(kernel):
    w = torch.from_numpy(make_weight("Q4_0", 4, 64))
    with pytest.raises(ValueError, match="ggml_type 1 is not supported"):
        kernel.mul_mat(torch.randn(1, 64), w, 1, 64)
    with pytest.raises(ValueError, match="k=48 must be a positive multiple of Q4_0's block of 32"):
        kernel.mul_mat(torch.randn(1, 48), w, 2, 48)
    with pytest.raises(ValueError, match=r"w must be a uint8 CPU tensor \[N, 36\]"):
        kernel.mul_mat(torch.randn(1, 64), w[:, :30], 2, 64)
    with pytest.raises(ValueError, match=r"x must be a float CPU tensor \[M, k=64\]"):
        kernel.mul_mat(torch.randn(1, 32), w, 2, 64)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernel.mul_mat(torch.randn(1, 64), w.t().contiguous().t(), 2, 64)


@pytest.mark.parametrize("name", TYPES + ["IQ4_NL", "IQ4_XS"])
def test_dequantized_rows_are_gguf_py_bits(kernel, name):
    """A packed token table's lookup (csrc/gguf_dequant.c) gives gguf-py's dequantize, bit for
    bit, for rows picked out of the table (a copy) and for a strided view of it."""
    t = type_id(name)
    table = torch.from_numpy(make_weight(name, 9, 512, seed=3))
    ids = torch.tensor([4, 0, 8, 4])
    got = kernel.dequantize(table[ids], t, 512)
    want = dequantized(name, table[ids].numpy())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    wide = torch.zeros(9, table.shape[1] + 8, dtype=torch.uint8)
    wide[:, 5:5 + table.shape[1]] = table
    view = wide[:, 5:5 + table.shape[1]]
    assert torch.equal(kernel.dequantize(view, t, 512).view(torch.int32), dequantized(name, table.numpy()).view(torch.int32))
    with pytest.raises(ValueError, match="must be a positive multiple"):
        kernel.dequantize(table[:, :10], t, 10)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_bound_product_is_mul_mat(kernel, name):
    """The decode hot path (checked once, then straight to the C call) gives mul_mat's bits, at
    every row count and inside the engine's single-threaded small-op region (its threads are
    the count torch had before)."""
    from lmplug.kit.threads import small_ops_single_threaded

    w = torch.from_numpy(make_weight(name, N, K, seed=5))
    bound = gguf_native.BoundProduct(kernel, w, type_id(name), K)
    for m in (1, 9):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        assert torch.equal(bound(x), kernel.mul_mat(x, w, type_id(name), K))
        with small_ops_single_threaded():
            assert torch.equal(bound(x), kernel.mul_mat(x, w, type_id(name), K))
    assert bound(torch.empty(0, K)).shape == (0, N)
    with pytest.raises(ValueError, match=r"x must be \[M, k=512\], got \(1, 256\)"):
        bound(torch.randn(1, 256))
    with pytest.raises(ValueError, match=r"w must be a uint8 CPU tensor \[N, \d+\]"):
        gguf_native.BoundProduct(kernel, w[:, :30], type_id(name), K)


def test_layer_product_is_the_runs_side_by_side_plus_bias(kernel):
    """The native decode step's product of a fused layer: each packed run gives mul_mat's bits
    in its columns (M = 1 and 9, 1 and 2 threads), the float runs (F16 / BF16 / F32 rows,
    float32 rows, float32 W^T) their float32 products, and the bias is added last."""
    from lmplug.kit.native import call_product

    gen = torch.Generator().manual_seed(7)
    q4 = torch.from_numpy(make_weight("Q4_1", N, K, seed=1))
    q6 = torch.from_numpy(make_weight("Q6_K", 16, K, seed=2))
    dense = torch.randn(5, K, generator=gen) * 0.05
    f16 = dense.half()
    bf16 = dense.bfloat16()
    runs = [(type_id("Q4_1"), q4), (type_id("Q6_K"), q6), (1, f16.view(torch.uint8)), (30, bf16.view(torch.uint8)),
            (0, dense.view(torch.uint8)), (None, dense), ("t", dense.t().contiguous())]
    total = N + 16 + 5 * 5
    bias = torch.randn(total, generator=gen)
    call = gguf_native.layer_product(kernel, runs, K, bias)
    for m in (1, 9):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        want = torch.cat([kernel.mul_mat(x, q4, type_id("Q4_1"), K), kernel.mul_mat(x, q6, type_id("Q6_K"), K),
                          x @ f16.float().t(), x @ bf16.float().t(), x @ dense.t(), x @ dense.t(), x @ dense.t()], 1)
        for threads in (1, 2):
            got = call_product(call, x, total, threads)
            assert torch.equal(got[:, :N + 16], want[:, :N + 16] + bias[:N + 16])
            torch.testing.assert_close(got, want + bias, rtol=1e-5, atol=1e-5)
    bad = [(type_id("Q4_1"), q4)] * 9
    with pytest.raises(ValueError, match="a layer of 9 runs; at most 8"):
        gguf_native.layer_product(kernel, bad, K, None)
    with pytest.raises(ValueError, match=r"the bias must be a contiguous float32 CPU tensor \(37,\)"):
        gguf_native.layer_product(kernel, runs[:1], K, bias[:5])
    with pytest.raises(ValueError, match=r"a type-1 run must be uint8 CPU rows \[n, 1024\]"):
        gguf_native.layer_product(kernel, [(1, dense)], K, None)


def test_bad_environment_is_named(kernel, monkeypatch):
    w = torch.from_numpy(make_weight("Q8_0", 4, 64))
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "sse9")
    with pytest.raises(ValueError, match="LMPLUG_GGUF_ISA='sse9' must be one of auto, generic, avx2, avxvnni, avx512"):
        kernel.mul_mat(torch.randn(1, 64), w, 8, 64)
    monkeypatch.delenv("LMPLUG_GGUF_ISA")
    monkeypatch.setenv("LMPLUG_GGUF_THREADS", "two")
    with pytest.raises(ValueError, match="LMPLUG_GGUF_THREADS='two' must be a positive integer"):
        gguf_native.mul_mat(torch.randn(1, 64), w, 8, 64)


def test_fake_implementation_gives_the_shape():
    x, w = torch.empty(5, 512, device="meta"), torch.empty(7, 288, dtype=torch.uint8, device="meta")
    out = torch.ops.lmplug_quant.gguf_mul_mat(x, w, 2, 512)
    assert out.shape == (5, 7) and out.dtype == torch.float32 and out.device.type == "meta"


def test_no_compiler_is_unavailable_with_the_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LMPLUG_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(gguf_native, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=gguf_native.__name__):
        first = gguf_native.available()
        second = gguf_native.available()
    assert first == second and first[0] is False and "no C compiler" in first[1] and "no-such-cc" in first[1]
    assert len([r for r in caplog.records if "native CPU kernels are not available" in r.getMessage()]) == 1
    with pytest.raises(NativeBuildError, match="no C compiler"):
        gguf_native.load()
    assert not (tmp_path / "kernels").exists() or list((tmp_path / "kernels").iterdir()) == []


def test_build_is_cached_under_the_cache_dir(kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("LMPLUG_CACHE", str(tmp_path))
    ok, path = gguf_native.available()
    assert ok and path.startswith(str(tmp_path / "kernels" / "gguf_cpu-")) and path.endswith(".so")
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [path.rsplit("/", 1)[1]]
    assert gguf_native.available() == (True, path)
