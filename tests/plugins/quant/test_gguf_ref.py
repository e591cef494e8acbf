"""The gguf method's PyTorch dequantize (``lmplug_quant.gguf_ref``) is bit-identical to gguf-py's
numpy ``dequantize`` (llama.cpp's formulas, written by its authors): on data gguf-py's own
quantizer writes, on random k-quant blocks, and on the demo model's tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from lmplug_quant import gguf_ref

from lmplug.interfaces.packed import PackedTensor

QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32]
K_QUANTS = [Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
IQ4 = [Q.IQ4_NL, Q.IQ4_XS]  # d first, then every bit pattern valid


def as_rows(data: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1).copy())


def random_k_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes for every field, with sane float16 ``d`` (and ``dmin``) in every block."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q6_K, Q.Q3_K):  # d last
        raw[:, size - 2:] = scales[:, :2]
    elif qtype in IQ4:  # d only (IQ4_XS's next 2 bytes are its scales' high bits)
        raw[:, 0:2] = scales[:, :2]
    else:
        raw[:, 0:4] = scales
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(4, 32), (9, 256), (3, 1024)])
def test_matches_gguf_py_on_quantized_data(qtype, shape):
    values = (np.random.default_rng(shape[1]).standard_normal(shape) * 0.7).astype(np.float32)
    data = quantize(values, qtype)
    expected = torch.from_numpy(dequantize(data, qtype).astype(np.float32).reshape(shape))
    ours = gguf_ref.dequantize(as_rows(data, shape[0]), int(qtype), shape[1])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


@pytest.mark.parametrize("qtype", K_QUANTS + IQ4, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_gguf_py_on_random_k_quant_blocks(qtype, seed):
    rows, cols = 6, 512
    raw = random_k_blocks(qtype, rows, cols, seed)
    expected = torch.from_numpy(dequantize(raw, qtype))
    assert expected.shape == (rows, cols) and torch.isfinite(expected).all()
    ours = gguf_ref.dequantize(torch.from_numpy(raw), int(qtype), cols)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_linear_is_x_times_dequantized_transposed():
    raw = torch.from_numpy(random_k_blocks(Q.Q4_K, 5, 256, seed=3))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    w = torch.from_numpy(dequantize(raw.numpy(), Q.Q4_K))
    torch.testing.assert_close(gguf_ref.linear(x, raw, int(Q.Q4_K), 256), x @ w.T, atol=1e-5, rtol=1e-5)


def test_packed_tensor_dequantize_and_rows():
    values = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    packed = PackedTensor(as_rows(quantize(values, Q.Q4_1), 6), int(Q.Q4_1), (6, 64), "w")
    dense = torch.from_numpy(dequantize(quantize(values, Q.Q4_1), Q.Q4_1))
    torch.testing.assert_close(packed.dequantize(), dense, atol=0, rtol=0)
    order = torch.tensor([5, 0, 3])
    torch.testing.assert_close(packed.rows(order).dequantize(), dense[order], atol=0, rtol=0)
    view = packed.rows(slice(2, 4))
    assert view.data.data_ptr() == packed.data[2].data_ptr()  # a slice is a view
    bad = PackedTensor(packed.data[:, :-1], int(Q.Q4_1), (6, 64), "w")
    with pytest.raises(ValueError, match=r"shape \(6, 64\) of type Q4_1 needs uint8 \(6, 40\)"):
        bad.check()


def test_demo_model_tensors(demo_gguf):
    """The real file: every type it holds, the first rows of each kind of tensor."""
    from gguf import GGUFReader

    reader = GGUFReader(demo_gguf)
    seen = set()
    for tensor in reader.tensors:
        if len(tensor.shape) != 2 or tensor.tensor_type in seen:
            continue
        seen.add(tensor.tensor_type)
        raw = np.asarray(tensor.data[:64])
        cols = int(tensor.shape[0])
        expected = torch.from_numpy(dequantize(raw, tensor.tensor_type).astype(np.float32).reshape(-1, cols))
        ours = gguf_ref.dequantize(torch.from_numpy(raw.view(np.uint8).copy()), int(tensor.tensor_type), cols)
        torch.testing.assert_close(ours, expected, atol=0, rtol=0, msg=tensor.name)
    assert {Q.Q4_1, Q.Q8_0} <= seen
