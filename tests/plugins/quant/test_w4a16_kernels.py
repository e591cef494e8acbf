"""The W4A16 Triton GEMM (``lmplug_quant.w4a16_kernels``) against its PyTorch reference
(unpack -> dequantize -> matmul), on ``kernel_device``: the CPU under ``TRITON_INTERPRET=1`` at
small sizes, or compiled on a CUDA GPU.

Shapes are chosen so tiles are partial in every direction (M, N, K not multiples of the
blocks). bf16 is not run under the interpreter: its ``tl.dot`` on bf16 is wrong
(docs/triton-on-cpu.md); it runs on GPUs (sm_80+).
"""

from __future__ import annotations

import pytest
import torch
from lmplug_quant.awq import awq_dequantize
from lmplug_quant.gptq import gptq_dequantize
from lmplug_quant.packing import AWQ_ORDER, pack_cols, pack_rows
from lmplug_quant.w4a16_kernels import w4a16_gemm
from support.devices import bf16_param, interpreted

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2), torch.bfloat16: (5e-2, 2e-2)}
DTYPES = [torch.float32, torch.float16, bf16_param(id="dtype2")]


def random_case(k: int, n: int, bits: int, group: int, act_order: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    groups = k // (k if group == -1 else group)
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    z = torch.randint(0, 2**bits, (groups, n), generator=gen)
    s = torch.rand(groups, n, generator=gen) * 0.02 + 0.001
    g_idx = (torch.arange(k) // (k // groups)).int()
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()
    return q, z, s, g_idx


def check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float().cpu(), ref, atol=atol * float(ref.abs().max()), rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("bits,group,act_order", [(4, 16, False), (4, 16, True), (4, -1, False),
                                                   (8, 16, True)])
def test_gptq_layout_matches_reference(m, bits, group, act_order, dtype, kernel_device):
    k, n = 80, 40
    q, z, s, g_idx = random_case(k, n, bits, group, act_order, seed=m + bits)
    qweight, qzeros = pack_rows(q, bits), pack_cols(z, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.float() @ gptq_dequantize(qweight, qzeros, s, g_idx, bits)
    args = [t.to(kernel_device) for t in (x, qweight, qzeros, s, g_idx)]
    check(w4a16_gemm(*args, bits=bits, awq_order=False), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("group", [16, -1])
def test_awq_layout_matches_reference(m, group, dtype, kernel_device):
    k, n = 48, 72
    q, z, s, g_idx = random_case(k, n, 4, group, False, seed=m)
    qweight, qzeros = pack_cols(q, 4, AWQ_ORDER), pack_cols(z, 4, AWQ_ORDER)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.float() @ awq_dequantize(qweight, qzeros, s, k if group == -1 else group)
    args = [t.to(kernel_device) for t in (x, qweight, qzeros, s, g_idx)]
    check(w4a16_gemm(*args, bits=4, awq_order=True), ref, dtype)


@pytest.mark.skipif(interpreted(), reason="GPU-sized shapes are too slow under the interpreter; the small "
                                          "cases above run the same code there")
@pytest.mark.parametrize("dtype", [torch.float16, bf16_param(id="bf16")])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("awq", [False, True], ids=["gptq", "awq"])
def test_gpu_sized_shapes_match_reference(m, awq, dtype, kernel_device):
    """The launch tables' M buckets (GEMV for decode, larger tiles for prefill) at a real layer's K."""
    k, n, group = 1024, 768, 128
    q, z, s, g_idx = random_case(k, n, 4, group, act_order=not awq, seed=m)
    if awq:
        qweight, qzeros = pack_cols(q, 4, AWQ_ORDER), pack_cols(z, 4, AWQ_ORDER)
        ref_w = awq_dequantize(qweight, qzeros, s, group)
    else:
        qweight, qzeros = pack_rows(q, 4), pack_cols(z, 4)
        ref_w = gptq_dequantize(qweight, qzeros, s, g_idx, 4)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    args = [t.to(kernel_device) for t in (x, qweight, qzeros, s, g_idx)]
    check(w4a16_gemm(*args, bits=4, awq_order=awq), x.float() @ ref_w, dtype)


def test_strided_input(kernel_device):
    q, z, s, g_idx = random_case(64, 32, 4, 32, False, seed=0)
    qweight, qzeros = pack_rows(q, 4), pack_cols(z, 4)
    x = torch.randn(64, 6)[:, :5].T  # [5, 64], not contiguous
    ref = x @ gptq_dequantize(qweight, qzeros, s, g_idx, 4)
    args = [t.to(kernel_device) for t in (torch.randn(64, 6), qweight, qzeros, s, g_idx)]
    args[0][:, :5] = x.T.to(kernel_device)
    check(w4a16_gemm(args[0][:, :5].T, *args[1:], bits=4), ref, torch.float32)


def test_bad_arguments_are_clear_errors():
    q, z, s, g_idx = random_case(64, 32, 4, 32, False, seed=0)
    qweight, qzeros = pack_rows(q, 4), pack_cols(z, 4)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="3-bit"):
        w4a16_gemm(x, qweight, qzeros, s, g_idx, bits=3)
    with pytest.raises(ValueError, match="8-bit.*AWQ"):
        w4a16_gemm(x, qweight, qzeros, s, g_idx, bits=8, awq_order=True)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemm(torch.randn(3, 72), qweight, qzeros, s, g_idx, bits=4)
    with pytest.raises(ValueError, match="g_idx"):
        w4a16_gemm(x, qweight, qzeros, s, g_idx[:10], bits=4)
    with pytest.raises(ValueError, match="int32"):
        w4a16_gemm(x, qweight, qzeros, s, g_idx.long(), bits=4)
