"""``lmplug_quant.packing`` against hand-written words from the published layouts."""

from __future__ import annotations

import pytest
import torch
from lmplug_quant.packing import AWQ_ORDER, pack_cols, pack_rows, unpack_cols, unpack_rows


def test_gptq_rows_lowest_nibble_is_lowest_row():
    values = torch.arange(1, 9).reshape(8, 1)  # rows 0..7 hold 1..8
    assert pack_rows(values, 4).item() & 0xFFFFFFFF == 0x87654321  # int32: the same bits


def test_top_nibble_sets_the_sign_bit():
    values = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]])
    word = pack_cols(values, 4)
    assert word.dtype == torch.int32 and word.item() == -(2**28)  # 0xF0000000
    assert torch.equal(unpack_cols(word, 4), values.int())


def test_awq_interleave():
    values = torch.arange(8).reshape(1, 8)  # column c holds c
    # nibble k holds column AWQ_ORDER[k] = [0, 2, 4, 6, 1, 3, 5, 7][k]
    assert pack_cols(values, 4, AWQ_ORDER).item() == 0x75316420
    assert torch.equal(unpack_cols(pack_cols(values, 4, AWQ_ORDER), 4, AWQ_ORDER), values.int())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_round_trips(bits):
    v = torch.randint(0, 2**bits, (64, 32), generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_rows(pack_rows(v, bits), bits), v.int())
    assert torch.equal(unpack_cols(pack_cols(v, bits), bits), v.int())


def test_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="3-bit"):
        pack_rows(torch.zeros(32, 4, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="outside"):
        pack_cols(torch.full((1, 8), 16), 4)
