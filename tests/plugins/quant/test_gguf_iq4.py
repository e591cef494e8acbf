"""The native kernels of IQ4_NL and IQ4_XS (csrc/gguf_cpu.c): the portable kernel bit-equal to a
float32 simulation of its math written from ggml's block layouts, every SIMD set this CPU runs
bit-equal to the portable kernel (row counts, weight rows not a multiple of 16, threads; the
AVX-512 panels also in test_gguf_panels.py), the
largest products exact, and the product close to gguf_ref's dequantize + matmul.

Weights: random bytes with sane fp16 scales (every bit pattern of an IQ4 block's indices and
IQ4_XS's 6-bit scales is valid).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lmplug_quant import gguf_ref
from support.gguf_weights import f16, make_weight, quantize_acts, type_id

gguf_native = pytest.importorskip("lmplug_quant.gguf_native")

TYPES = ["IQ4_NL", "IQ4_XS"]
# ggml-common.h's kvalues_iq4nl
KVALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float64)
# (n weight rows, k): K = 256 * n, rows not a multiple of 16; IQ4_NL also 7 and 18 blocks (not a multiple of 4)
SHAPES = {"IQ4_NL": [(37, 224), (16, 576), (5, 1024)], "IQ4_XS": [(37, 256), (16, 768), (5, 1024)]}
ROW_COUNTS = (*range(1, 10), 16, 17, 33)


def integer_weights(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: integer weights [N, nb, elems] (IQ4_XS: each sub-block's value times its scale
    - 32) and the block's float scale d [N, nb]."""
    size = gguf_native.BLOCKS[type_id(name)][1]
    b = w.reshape(w.shape[0], -1, size)
    qs = b[..., 2:] if name == "IQ4_NL" else b[..., 8:]
    qs = qs.long().reshape(*b.shape[:2], -1, 16)
    q = KVALUES[torch.cat([qs & 15, qs >> 4], -1)].reshape(*b.shape[:2], -1)  # byte i: element i, then i + 16
    if name == "IQ4_XS":
        high = b[..., 2].long() | b[..., 3].long() << 8
        s = torch.arange(8)
        ls = ((b[..., 4 + s // 2].long() >> (4 * (s % 2))) & 15) | (((high[..., None] >> (2 * s)) & 3) << 4)
        q = (q.reshape(*b.shape[:2], 8, 32) * (ls - 32)[..., None].double()).reshape(*b.shape[:2], 256)
    return q, f16(b[..., 0:2])


def portable_bits(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The portable kernel's float32 result, operation for operation: per block the exact
    integer dot product, then acc += (d_w * d_x) * (float)dot in block order."""
    elems = gguf_native.BLOCKS[type_id(name)][0]
    qx, dx = quantize_acts(x, elems)
    wi, dw = integer_weights(name, w)
    dots = torch.einsum("mbe,nbe->mnb", qx, wi).float()  # exact integers, rounded to float32 as (float)isum
    terms = (dw[None] * dx[:, None]) * dots
    acc = torch.zeros(x.shape[0], w.shape[0])
    for b in range(terms.shape[-1]):
        acc = acc + terms[..., b]
    return acc


@pytest.mark.parametrize("name", TYPES)
def test_portable_kernel_is_the_simulation(kernel, monkeypatch, name):
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
    for n, k in SHAPES[name]:
        w = torch.from_numpy(make_weight(name, n, k, seed=k))
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(k)) * 2
        got = kernel.mul_mat(x, w, type_id(name), k)
        assert torch.equal(got, portable_bits(name, x, w)), (n, k)


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "avx512", "neon", "dotprod"])
@pytest.mark.parametrize("name", TYPES)
def test_simd_sets_give_the_portable_bits(kernel, monkeypatch, name, isa):
    if isa not in gguf_native.ISAS or gguf_native.ISAS.index(kernel.best_isa) < gguf_native.ISAS.index(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernels: {gguf_native.describe_isa(kernel.best_isa)}")
    for n, k in SHAPES[name]:
        w = torch.from_numpy(make_weight(name, n, k, seed=n))
        x = torch.randn(33, k, generator=torch.Generator().manual_seed(n)) * 3
        monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
        want = kernel.mul_mat(x, w, type_id(name), k, num_threads=1)
        monkeypatch.setenv("LMPLUG_GGUF_ISA", isa)
        for m in ROW_COUNTS:
            for threads in (1, 2):
                got = kernel.mul_mat(x[:m], w, type_id(name), k, num_threads=threads)
                assert torch.equal(got, want[:m]), (n, k, m, threads, (got - want[:m]).abs().max())
        bound = gguf_native.BoundProduct(kernel, w, type_id(name), k)  # the decode hot path (rows in huge pages)
        assert torch.equal(bound(x[:3]), want[:3])


@pytest.mark.parametrize("isa", ["generic", "auto"])
@pytest.mark.parametrize("name", TYPES)
def test_largest_products_are_exact(kernel, monkeypatch, name, isa):
    """Every index 0 (the value -127; IQ4_XS's scales all 63 - 32 = 31) times activations of
    magnitude 127 with the opposite sign: the SIMD kernels' int16 pair sums reach 2 * 127 * 127
    and must not saturate."""
    k, n, t = 256 * 2, 19, type_id(name)
    elems, size = gguf_native.BLOCKS[t]
    blocks = np.zeros((n, k // elems, size), dtype=np.uint8)
    blocks[..., 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if name == "IQ4_XS":
        blocks[..., 2:8] = 0xFF  # every 6-bit scale 63
    w = torch.from_numpy(blocks.reshape(n, -1))
    monkeypatch.setenv("LMPLUG_GGUF_ISA", isa)
    for m in (1, 8, 9):
        x = -torch.ones(m, k) * torch.linspace(1, 2, m)[:, None]
        assert (quantize_acts(x, elems)[0].abs() == 127).all()  # the products are as large as planned
        got = kernel.mul_mat(x, w, t, k, num_threads=1)
        assert torch.equal(got, portable_bits(name, x, w))
        assert (got > 0).all()


@pytest.mark.parametrize("m", [1, 8, 33])
@pytest.mark.parametrize("name", TYPES)
def test_close_to_the_reference_product(kernel, name, m):
    n, k = SHAPES[name][-1]
    w = torch.from_numpy(make_weight(name, n, k, seed=1))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(10 + m))
    want = gguf_ref.linear(x, w, type_id(name), k).double()
    got = torch.ops.lmplug_quant.gguf_mul_mat(x, w, type_id(name), k)
    # 8-bit activations (one scale per 32 or 256 values), as for the other types: under 2 %
    assert (got.double() - want).norm() / want.norm() < 0.02


@pytest.mark.parametrize("name", TYPES)
def test_panels_hold_the_rows_bytes(kernel, name):
    """The AVX-512 panels (test_gguf_panels.py runs their kernels) give back the file's bytes,
    every bit of IQ4_XS's packed 6-bit scales included."""
    n, k = 37, 512
    w = torch.from_numpy(make_weight(name, n, k, seed=9))
    panels = kernel.panels(w, type_id(name), k)
    assert panels.numel() == 48 * (k // gguf_native.BLOCKS[type_id(name)][0]) * {"IQ4_NL": 18, "IQ4_XS": 138}[name]
    assert torch.equal(kernel.rows(panels, type_id(name), n, k), w)
