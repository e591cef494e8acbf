"""Quantized linear layers below the engine, against their definitions: the Triton scaled GEMM of
W8A8 (fp8, int8; per-row or per-group scales) under ``TRITON_INTERPRET=1`` on CPU, every
layer path of each scheme agreeing, the W4A16 split-K decode GEMV, and weight-only int4/int8
through torch's packed CPU matmuls. Checkpoints in the engine: test_quant_w8a8.py.
"""

from __future__ import annotations

import pytest
import torch
from support import quant_packers as qp
from support.devices import kernel_device
from support.hf_models import one_torch_thread  # noqa: F401
from support.quant_checkpoints import ct_config

from lmplug import ModelLoadError

# -- the Triton scaled GEMM against its reference (TRITON_INTERPRET=1 on CPU) --------------------

DEVICE = kernel_device() or "cpu"  # the interpreter's CPU, or a CUDA GPU with the kernels compiled


SCHEMES = {
    "fp8_channel_token": {"kind": "fp8", "weight_strategy": "channel", "act": "token"},
    "fp8_tensor_dynamic_tensor": {"kind": "fp8", "weight_strategy": "tensor", "act": "tensor"},
    "fp8_block_group": {"kind": "fp8", "weight_strategy": "block", "act": "group", "block": (32, 32), "act_group": 32},
    "fp8_block_token": {"kind": "fp8", "weight_strategy": "block", "act": "token", "block": (16, 48)},
    "int8_channel_token": {"kind": "int8", "weight_strategy": "channel", "act": "token"},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_layer_paths_agree(scheme, dtype):
    """A layer quantizing a float weight at load: the Triton path, the per-call reference and the
    CPU default compute the same, from activations quantized once by the same code."""
    from lmplug_quant.w8a8_common import W8A8Linear, W8A8Options, W8A8Scheme

    s = W8A8Scheme(serialized=False, method="test", **SCHEMES[scheme])
    in_f, out_f = 96, 40
    weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(1)) * 0.05
    bias = torch.randn(out_f, generator=torch.Generator().manual_seed(2))
    outputs = {}
    for path, options in {"triton": {"kernel": "triton"}, "reference": {"kernel": "torch",
                          "dequantize_at_load": False}, "default": {}}.items():
        method = W8A8Linear(W8A8Options(**options), s)
        layer = torch.nn.Module()
        method.create_weights(layer, in_f, out_f, dtype, bias=True)
        layer.weight.data.copy_(weight)
        layer.bias.data.copy_(bias)
        method.process_weights_after_loading(layer)
        assert (layer.path == "triton") == (path == "triton")
        for m in (1, 4, 19):
            x = torch.randn(m, in_f, generator=torch.Generator().manual_seed(m)).to(dtype)
            y = method.apply(layer, x)
            assert y.dtype == dtype and y.shape == (m, out_f)
            outputs.setdefault(m, {})[path] = y.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for m, ys in outputs.items():
        for path in ("triton", "default"):
            torch.testing.assert_close(ys[path], ys["reference"], atol=tol * float(ys["reference"].abs().max()),
                                       rtol=tol)


# -- W4A16 decode: the split-K GEMV (lmplug_quant.w4a16_kernels) ----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # no tl.dot: bf16 too
@pytest.mark.parametrize("m,split_k", [(1, 1), (1, 3), (2, None), (4, 5)])
@pytest.mark.parametrize("layout", ["gptq_actorder", "awq"])
def test_w4a16_gemv_matches_reference(layout, m, split_k, dtype):
    from lmplug_quant.awq import awq_dequantize
    from lmplug_quant.gptq import gptq_dequantize
    from lmplug_quant.packing import AWQ_ORDER, pack_cols, pack_rows
    from lmplug_quant.w4a16_kernels import w4a16_gemv

    k, n, group = 160, 72, 32  # K: 5 blocks of 32 over the splits; N: a partial 64-wide tile
    gen = torch.Generator().manual_seed(m * 10 + (split_k or 0))
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group, n), generator=gen)
    s = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    g_idx = (torch.arange(k) // group).int()
    if layout == "awq":
        qweight, qzeros = pack_cols(q, 4, AWQ_ORDER), pack_cols(z, 4, AWQ_ORDER)
        w = awq_dequantize(qweight, qzeros, s, group)
    else:
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()
        qweight, qzeros = pack_rows(q, 4), pack_cols(z, 4)
        w = gptq_dequantize(qweight, qzeros, s, g_idx, 4)
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = x.double() @ w.double()
    args = [t.to(DEVICE) for t in (x, qweight, qzeros, s, g_idx)]
    y = w4a16_gemv(*args, bits=4, awq_order=layout == "awq", split_k=split_k)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(y.double().cpu(), want, atol=tol * float(want.abs().max()), rtol=tol)


# -- weight-only int4/int8 through torch's packed CPU matmuls (bfloat16, dequantize_at_load: false) --

def packed_case(name: str):
    """(method, checkpoint tensors, the dense [out, in] they stand for) for a 128 -> 64 layer."""
    from lmplug_quant.awq import AWQ
    from lmplug_quant.compressed_tensors import CompressedTensors
    from lmplug_quant.gptq import GPTQ
    from lmplug_quant.rtn import RTN

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    options = {"dequantize_at_load": False}
    if name == "gptq":
        tensors, dense = qp.gptq_tensors(weight, bits=4, group_size=32, desc_act=False, v1=True)
        return GPTQ(GPTQ.Options(bits=4, group_size=32, **options)), tensors, dense
    if name == "awq":
        tensors, dense = qp.awq_tensors(weight, group_size=32)
        return AWQ(AWQ.Options(group_size=32, **options)), tensors, dense
    if name == "ct_int4":
        tensors, dense = qp.pack_quantized(weight, 4, 32)
        config = ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                              "group_size": 32}, None)
        return CompressedTensors(CompressedTensors.from_checkpoint_config(config).model_copy(
            update=options)), tensors, dense
    bits, group = (4, 32) if name == "rtn4" else (8, -1)
    weight = weight.bfloat16().float()  # RTN quantizes the weight as the bf16 model holds it
    dense = torch.empty_like(weight)
    qmax = 2 ** (bits - 1) - 1
    size = 128 if group == -1 else group
    for start in range(0, 128, size):
        block = weight[:, start:start + size]
        scale = block.abs().amax(1, keepdim=True) / qmax
        dense[:, start:start + size] = torch.round(block / scale).clamp(-qmax - 1, qmax) * scale
    return RTN(RTN.Options(bits=bits, group_size=group, **options)), {"weight": weight}, dense


def build_layer(method, tensors, dtype):
    layer = torch.nn.Module()
    layer.in_features, layer.out_features = 128, 64
    method.create_weights(layer, 128, 64, dtype, bias=True)
    own = dict(layer.named_parameters())
    for name, value in tensors.items():
        own[name].data.copy_(value)
    own["bias"].data.copy_(torch.linspace(-1, 1, 64))
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("name", ["gptq", "awq", "ct_int4", "rtn4", "rtn8"])
def test_torch_packed_cpu_matmul_matches_dequantized(name):
    method, tensors, dense = packed_case(name)
    layer = build_layer(method, tensors, torch.bfloat16)
    assert hasattr(layer, "int8pack" if name == "rtn8" else "int4pack")  # the packed op really runs
    for m in (1, 5):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = method.apply(layer, x)
        want = x.double() @ dense.double().T + torch.linspace(-1, 1, 64).bfloat16().double()
        assert y.dtype == torch.bfloat16 and y.shape == (m, 64)
        torch.testing.assert_close(y.double(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)


def test_torch_packed_only_where_it_runs():
    from lmplug_quant.gptq import GPTQ

    method, tensors, _ = packed_case("gptq")
    assert not hasattr(build_layer(method, tensors, torch.float32), "int4pack")  # auto: fp32 stays put
    forced = GPTQ(GPTQ.Options(bits=4, group_size=32, dequantize_at_load=False, kernel="torch_packed"))
    with pytest.raises(ModelLoadError, match="torch_packed.*bfloat16"):
        build_layer(forced, tensors, torch.float32)
    act_order, _ = qp.gptq_tensors(torch.randn(64, 128) * 0.05, bits=4, group_size=32, desc_act=True, v1=True)
    with pytest.raises(ModelLoadError, match="act-order"):
        build_layer(forced, act_order, torch.bfloat16)
