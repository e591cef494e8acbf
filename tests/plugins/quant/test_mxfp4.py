"""MXFP4 (OCP MX v1.0: blocks of 32 FP4 E2M1 values with one E8M0 scale): the PyTorch reference
bit-exact against the format written out from its definition here and against transformers' own
conversion (``integrations/mxfp4.py``); the native CPU kernel (portable, AVX2, AVX-512; 1 and 2
threads) and the Triton
kernel (under ``TRITON_INTERPRET=1`` without a GPU) against the reference; the quant method's
refusals."""

from __future__ import annotations

import math

import pytest
import torch


def ocp_e2m1(nibble: int) -> float:
    """OCP MX v1.0, FP4 E2M1: sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0;
    exponent 0 is subnormal (0.m x 2^0 = m / 2)."""
    sign = -1.0 if nibble & 8 else 1.0
    exp, man = (nibble >> 1) & 3, nibble & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def ocp_e8m0(scale: int) -> float:
    """OCP MX v1.0, E8M0: 2^(scale - 127), 0xFF is NaN."""
    return math.nan if scale == 255 else 2.0 ** (scale - 127)


def random_mxfp4(rows: int, groups: int, seed: int = 0, low: int = 118, high: int = 130):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(low, high, (rows, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


def test_dequantize_is_bit_exact_to_the_ocp_format():
    from lmplug_quant import mxfp4_ref

    # every byte value in every position, under every scale (one block row per scale)
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(256, 1, 1).view(256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 16).contiguous()
    got = mxfp4_ref.dequantize(blocks, scales)  # [256, 512]
    expected = torch.empty(256, 16, 32, dtype=torch.float64)
    for s in range(256):
        for g in range(16):
            for j in range(16):
                byte = g * 16 + j
                expected[s, g, 2 * j] = ocp_e2m1(byte & 15) * ocp_e8m0(s)
                expected[s, g, 2 * j + 1] = ocp_e2m1(byte >> 4) * ocp_e8m0(s)
    expected = expected.view(256, 512).float()  # exact: every value is representable in float32
    assert torch.equal(got[:255].view(torch.int32), expected[:255].view(torch.int32))  # -0.0 included
    assert got[255].isnan().all()


def test_dequantize_matches_transformers_conversion():
    from lmplug_quant import mxfp4_ref
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(3 * 40, 6, low=0, high=255)  # transformers reads scale 255 as 2^128
    blocks, scales = blocks.view(3, 40, 6, 16), scales.view(3, 40, 6)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(mxfp4_ref.dequantize(blocks, scales).transpose(1, 2), theirs)


def native_isas():
    from lmplug_quant import mxfp4_native

    kernel, why = mxfp4_native.available()
    if kernel is None:
        pytest.skip(f"the native MXFP4 kernel does not build here: {why}")
    return kernel, mxfp4_native.ISAS[:mxfp4_native.ISAS.index(kernel.best_isa) + 1]


def test_native_dequantize_is_bit_exact_in_every_kernel_set():
    from lmplug_quant import mxfp4_ref

    kernel, isas = native_isas()
    blocks, scales = random_mxfp4(37, 5, low=0, high=256)
    expected = mxfp4_ref.dequantize(blocks, scales)
    for isa in isas:
        got = kernel.dequantize(blocks, scales, isa=isa)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), isa


@pytest.mark.parametrize("m, n, groups", [(1, 40, 3), (7, 33, 4), (16, 64, 2)])
def test_native_linear_matches_the_reference(m, n, groups):
    from lmplug_quant import mxfp4_ref

    kernel, isas = native_isas()
    blocks, scales = random_mxfp4(n, groups, seed=m)
    g = torch.Generator().manual_seed(1)
    x, bias = torch.randn(m, groups * 32, generator=g), torch.randn(n, generator=g)
    expected = x.double() @ mxfp4_ref.dequantize(blocks, scales, torch.float64).T + bias.double()
    for isa in isas:
        got = kernel.linear(x, blocks, scales, bias, isa=isa)
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5, msg=lambda s, i=isa: f"{i}: {s}")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_native_simd_linear_against_the_portable_kernel_on_1_and_2_threads(isa):
    """Each SIMD set the CPU runs against the portable kernel: AVX-512 bit for bit (the same lane
    sums and reduction), AVX2 within float rounding (FMA, its own order); every set gives the same
    bits on 1 and 2 threads (the rows split over the GGUF kernels' pool)."""
    from lmplug_quant import mxfp4_native

    kernel, isas = native_isas()
    if isa not in isas:
        pytest.skip(f"this CPU (or /proc/cpuinfo) lacks {isa}: {', '.join(mxfp4_native.ISA_FLAGS[isa])}")
    if kernel.threads_used(1, 2880, 700, 2) < 2:
        pytest.skip("the GGUF kernels' thread pool is not available here: one thread only")
    blocks, scales = random_mxfp4(700, 90, seed=3, low=0, high=136)  # subnormal scales to 2^8: sums stay finite
    g = torch.Generator().manual_seed(4)
    for m in (1, 5):
        x, bias = torch.randn(m, 90 * 32, generator=g), torch.randn(700, generator=g)
        portable = kernel.linear(x, blocks, scales, bias, isa="generic", threads=1)
        assert torch.equal(kernel.linear(x, blocks, scales, bias, isa="generic", threads=2), portable)
        one, two = (kernel.linear(x, blocks, scales, bias, isa=isa, threads=t) for t in (1, 2))
        assert torch.equal(one, two), f"{isa}: 1 and 2 threads differ"
        if isa == "avx512":
            assert torch.equal(one, portable)
        else:
            torch.testing.assert_close(one, portable, rtol=1e-5, atol=1e-5 * float(portable.abs().max()))


def test_native_isa_is_bounded_by_proc_cpuinfo(monkeypatch):
    """A set /proc/cpuinfo's flags do not list is never chosen, whatever CPUID says."""
    from lmplug_quant import mxfp4_native

    from lmplug.kit import native_build

    monkeypatch.setattr(native_build, "cpu_id", lambda: "flags\t\t: fpu sse2 avx2 fma")
    assert native_build.bounded_isa("avx512", mxfp4_native.ISAS, mxfp4_native.ISA_FLAGS) == "avx2"
    monkeypatch.setattr(native_build, "cpu_id", lambda: "flags\t\t: fpu sse2 avx512f")
    assert native_build.bounded_isa("avx512", mxfp4_native.ISAS, mxfp4_native.ISA_FLAGS) == "generic"


@pytest.mark.parametrize("m, n, groups, dtype", [(1, 40, 3, torch.float32), (17, 33, 4, torch.float32),
                                                 (5, 48, 2, torch.float16), (5, 48, 2, torch.bfloat16)])
def test_triton_linear_matches_the_reference(m, n, groups, dtype):
    from lmplug_quant import mxfp4_kernels, mxfp4_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 (tests/conftest.py)
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly (as for the other kernels' suites)")
    blocks, scales = random_mxfp4(n, groups, seed=n)
    scales[0, 0] = 0  # the subnormal scale 2^-127
    g = torch.Generator().manual_seed(2)
    x, bias = torch.randn(m, groups * 32, generator=g).to(dtype), torch.randn(n, generator=g)
    got = mxfp4_kernels.linear(x.to(device), blocks.to(device), scales.to(device), bias.to(device))
    expected = x.double() @ mxfp4_ref.dequantize(blocks, scales, torch.float64).T + bias.double()
    tol = {torch.float32: (1e-4, 1e-5), torch.float16: (0.1, 1e-2), torch.bfloat16: (0.5, 2e-2)}[dtype]
    torch.testing.assert_close(got.cpu().double(), expected, atol=tol[0], rtol=tol[1])


def test_a_layer_whose_inputs_are_no_whole_blocks_is_refused():
    from lmplug_quant.mxfp4 import MXFP4

    from lmplug.errors import ModelLoadError
    from lmplug.kit.layers import Linear

    with pytest.raises(ModelLoadError, match="not a multiple of the format's blocks of 32"):
        Linear(48, {"down": 8}, bias=True, dtype=torch.float32, quant=MXFP4(MXFP4.Options(kernel="torch")))


def test_only_experts_are_mxfp4():
    from lmplug_quant.mxfp4 import MXFP4

    from lmplug.api import Unquantized

    method = MXFP4(MXFP4.Options(kernel="torch"))
    assert method.method_for_layer(["model.layers.0.mlp.experts.gate_up_proj.3"]) is method
    assert isinstance(method.method_for_layer(["model.layers.0.self_attn.q_proj"]), Unquantized)
