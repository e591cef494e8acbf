"""The kit's C product for the core's plain float32 weights (``lmplug.kit.native_dense``) against
float64 matmuls: tiles and their tails (rows not a multiple of 4, columns not of 32), bias or none,
through ``lmplug.kit.native.call_product`` as the native decode step calls it."""

from __future__ import annotations

import pytest
import torch

from lmplug.interfaces.quant import Unquantized
from lmplug.kit import fused_cpu, native_dense
from lmplug.kit.layers import Linear
from lmplug.kit.native import call_product

pytestmark = pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native product")


def _linear(k: int, n: int, bias: bool) -> Linear:
    g = torch.Generator().manual_seed(k * n)
    quant = Unquantized()
    layer = Linear(k, {"proj": n}, bias=bias, dtype=torch.float32, quant=quant)
    layer.weight.data.copy_(torch.randn(n, k, generator=g))
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=g))
    quant.process_weights_after_loading(layer)  # W^T on the CPU
    return layer


@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (3, 64, 32), (5, 33, 70), (16, 96, 3), (4, 2, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_product_matches_the_float64_matmul(torch_threads, m, k, n, bias):
    torch_threads(1)
    layer = _linear(k, n, bias)
    call = native_dense.product(layer)
    assert call is not None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = torch.nn.functional.linear(x.double(), layer.weight.double(), None if not bias else layer.bias.double())
    got = call_product(call, x, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(got, layer.quant.apply(layer, x), rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_no_product_where_it_does_not_apply(torch_threads):
    torch_threads(1)
    layer = _linear(8, 8, False)
    row_major = _linear(8, 8, False)
    row_major.weight.data = row_major.weight.data.contiguous()
    half = _linear(8, 8, False)
    half.weight.data = half.weight.data.bfloat16()
    assert native_dense.product(row_major) is None and native_dense.product(half) is None
    torch_threads(2)
    assert native_dense.product(layer) is None  # one-threaded: more threads keep torch's BLAS


def test_weights_move_into_huge_pages_with_the_same_bits(torch_threads, monkeypatch):
    """The product's weight is moved into huge-page memory once (same values, same W^T strides);
    the product and torch's path give the bits they give with ``LMPLUG_HUGE_PAGES=0``."""
    from lmplug.kit import hugemem

    torch_threads(1)
    monkeypatch.delenv("LMPLUG_HUGE_PAGES", raising=False)
    if not hugemem.enabled():
        pytest.skip("no huge-page memory here (not Linux)")
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(7))
    monkeypatch.setenv("LMPLUG_HUGE_PAGES", "0")
    plain = _linear(96, 70, True)
    before = plain.weight.data_ptr()
    want = call_product(native_dense.product(plain), x, 70)
    assert plain.weight.data_ptr() == before  # off: left where it is
    monkeypatch.delenv("LMPLUG_HUGE_PAGES")
    layer = _linear(96, 70, True)
    values = layer.weight.detach().clone()
    old = layer.weight.data_ptr()
    call = native_dense.product(layer)
    moved = layer.weight.data_ptr()
    assert moved != old and moved % hugemem.ALIGN == 0 and layer.weight.stride() == (1, 70)
    assert torch.equal(layer.weight, values)
    assert torch.equal(call_product(call, x, 70), want)
    assert torch.equal(layer.quant.apply(layer, x), plain.quant.apply(plain, x))
    native_dense.product(layer)
    assert layer.weight.data_ptr() == moved  # once


@pytest.mark.parametrize("biases", [(False, False, False), (True, False, True)], ids=["no-bias", "some-bias"])
def test_stacked_product_of_separate_weights(torch_threads, biases):
    """Separate [out_i, in] weights (an EAGLE head's q/k/v ``nn.Linear``s) as one product over a
    W^T copy: the float64 matmul of the rows stacked, missing biases zero; each weight moved into
    the copy (a view of its rows, same values) and its module's output the same."""
    torch_threads(1)
    g = torch.Generator().manual_seed(3)
    linears = [torch.nn.Linear(96, n, bias=b) for n, b in zip((64, 32, 33), biases)]
    x = torch.randn(5, 96, generator=g)
    before = [(m.weight.detach().clone(), m(x)) for m in linears]
    call = native_dense.stacked([m.weight for m in linears], [m.bias for m in linears], "test qkv")
    assert call is not None and call.name == "test qkv"
    want = torch.cat([torch.nn.functional.linear(x.double(), m.weight.double(),
                                                 None if m.bias is None else m.bias.double()) for m in linears], -1)
    got = call_product(call, x, 129)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * 96 ** 0.5)
    first = linears[0].weight.data_ptr()
    for i, (m, (w, out)) in enumerate(zip(linears, before)):
        assert torch.equal(m.weight, w) and m.weight.stride() == (1, 129)
        assert m.weight.data_ptr() == first + 4 * (0, 64, 96)[i]  # its rows of the one copy
        torch.testing.assert_close(m(x), out, rtol=1e-6, atol=1e-6)
    torch_threads(2)
    assert native_dense.stacked([m.weight for m in linears], [None] * 3, "test") is None
