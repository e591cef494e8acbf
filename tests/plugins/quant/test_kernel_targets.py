"""The quantized GEMMs as built for real GPUs: launch tables per architecture and M bucket, W8A8
scale groups that no 8-bit K step of 32+ divides (48, 40, 16), W4A16 with one scale row per K step
over several groups, and the fp8 capability check at load.

Kernels run under ``TRITON_INTERPRET=1`` on CPU (or compiled on a GPU), against definitions
computed here in float64; ``target_capability`` makes the launch wrappers pick the sm_80 / sm_90
tiles, so those tile shapes run here too (warps and stages only matter to a compiler).
"""

from __future__ import annotations

import pytest
import torch
from lmplug_quant.gptq import gptq_dequantize
from lmplug_quant.packing import pack_cols, pack_rows
from lmplug_quant.w4a16_kernels import (
    GEMV_MAX_M,
    contiguous_group_size,
    gemm_config,
    gemv_config,
    w4a16_gemm,
    w4a16_gemv,
)
from lmplug_quant.w8a8_kernels import w8a8_config, w8a8_gemm
from support.devices import kernel_device
from support.w8a8_operands import definition, operands

from lmplug import ModelLoadError
from lmplug.kit.devices import target_capability

DEVICE = kernel_device() or "cpu"  # the interpreter's CPU, or a CUDA GPU with the kernels compiled
SM80, SM90 = (8, 0), (9, 0)


# -- W8A8: scale groups of any width -------------------------------------------------------------

@pytest.mark.parametrize("kind,group_k,k,target", [
    ("int8", 48, 120, None), ("fp8", 48, 120, None), ("int8", 48, 120, SM80), ("fp8", 48, 120, SM90),
    ("fp8", 40, 100, SM90), ("int8", 16, 80, SM80), ("fp8", 16, 80, None)])
def test_w8a8_groups_not_a_multiple_of_32(kind, group_k, k, target):
    """48 (and 40, 16) used to get a 16-wide K step, which 8-bit tl.dot refuses on every GPU."""
    m, n = 5, 40  # K: two and a half groups, the last one partial
    a, sa, w, sw = operands(kind, m, n, k, group_k, seed=group_k + m, spread=True)
    want = definition(a, sa, w, sw, group_k)
    args = [t.to(DEVICE) for t in (a, sa, w, sw)]
    if target is None:
        y = w8a8_gemm(*args, group_k=group_k, out_dtype=torch.float32)
    else:
        assert w8a8_config(target, m, n, k, group_k).block_k >= 32
        with target_capability(target):
            y = w8a8_gemm(*args, group_k=group_k, out_dtype=torch.float32)
    torch.testing.assert_close(y.double().cpu(), want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def test_w8a8_k_steps_are_never_below_32():
    for cap in (None, SM80, SM90):
        for group_k in (0, 16, 32, 40, 48, 64, 96, 128, 192, 256):
            for m in (1, 8, 48, 1000):
                cfg = w8a8_config(cap, m, 4096, 4096, group_k)
                assert cfg.block_k >= 32, (cap, group_k, m)
                if group_k and cap is not None:
                    assert cfg.block_k <= 128  # fp8 promotes to fp32 at least every 128 inputs


def test_w8a8_table_per_architecture_and_m():
    decode80, prefill80 = w8a8_config(SM80, 1, 4096, 4096), w8a8_config(SM80, 4096, 4096, 4096)
    decode90, prefill90 = w8a8_config(SM90, 1, 4096, 4096), w8a8_config(SM90, 4096, 4096, 4096)
    # GEMV-shaped for one token: 16 rows (tl.dot's least), a wide K step
    assert decode80.block_m == decode90.block_m == 16 and decode80.block_k >= 128
    # prefill: 128 x 128 tiles with 8 warps; Hopper pipelines deeper and takes a wider K step
    assert (prefill80.block_m, prefill80.block_n, prefill80.num_warps) == (128, 128, 8)
    assert (prefill90.block_m, prefill90.block_n, prefill90.num_warps) == (128, 128, 8)
    assert prefill90.num_stages > prefill80.num_stages and prefill90.block_k > prefill80.block_k
    # with scale groups (a second fp32 tile per step) Hopper's prefill K step narrows to stay spill-free
    assert w8a8_config(SM90, 4096, 4096, 4096, 128).block_k == 64
    assert decode90 != decode80
    mid = {cap: w8a8_config(cap, 48, 4096, 4096) for cap in (SM80, SM90)}
    assert mid[SM80].block_m == mid[SM90].block_m == 64 and mid[SM80] != mid[SM90]
    # a wide N takes wider N tiles at decode
    assert w8a8_config(SM90, 1, 32768, 4096).block_n > decode90.block_n
    # no GPU: the interpreter's small tiles
    assert w8a8_config(None, 4096, 4096, 4096).block_m == 64


# -- W4A16: a scale row per K step, several groups per K range ------------------------------------

def gptq_case(k: int, n: int, group: int, seed: int, act_order: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group, n), generator=gen)
    s = 10 ** (torch.rand(k // group, n, generator=gen) * 2 - 3)  # groups differ by up to 100x
    g_idx = (torch.arange(k) // group).int()
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()
    qweight, qzeros = pack_rows(q, 4), pack_cols(z, 4)
    return qweight, qzeros, s, g_idx, gptq_dequantize(qweight, qzeros, s, g_idx, 4)


def check(y: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(y.double().cpu(), want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("m,target", [(1, None), (3, SM90), (8, SM80), (20, None), (20, SM80), (33, SM90)])
def test_w4a16_contiguous_groups_match_reference(m, target):
    """K = 256 in groups of 32: every split (GEMV) and every tile's K walk (GEMM) crosses several
    groups, each step reading its group's one row of scales and zeros."""
    k, n, group = 256, 72, 32
    qweight, qzeros, s, g_idx, w = gptq_case(k, n, group, seed=m)
    assert contiguous_group_size(g_idx, s.shape[0]) == group
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
    want = x.double() @ w.double()
    args = [t.to(DEVICE) for t in (x, qweight, qzeros, s, g_idx)]
    pick = gemv_config if m <= GEMV_MAX_M else gemm_config
    cfg, group_arg = pick(target, m, n, k, group)
    assert group_arg == group and group % cfg.block_k == 0  # every K step inside one group
    if target is None:
        check(w4a16_gemm(*args, bits=4, group_size=group), want)
    else:
        with target_capability(target):
            check(w4a16_gemm(*args, bits=4, group_size=group), want)


@pytest.mark.parametrize("split_k", [2, 3])
def test_w4a16_gemv_splits_over_several_groups(split_k):
    k, n, group = 384, 40, 64  # 6 groups; 2 or 3 of them in each split
    qweight, qzeros, s, g_idx, w = gptq_case(k, n, group, seed=split_k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(9))
    args = [t.to(DEVICE) for t in (x, qweight, qzeros, s, g_idx)]
    check(w4a16_gemv(*args, bits=4, split_k=split_k, group_size=group), x.double() @ w.double())


def test_w4a16_group_size_checks():
    qweight, qzeros, s, g_idx, _ = gptq_case(128, 32, 32, seed=0, act_order=True)
    assert contiguous_group_size(g_idx, s.shape[0]) is None  # act-order: read through g_idx
    assert contiguous_group_size(torch.arange(128, dtype=torch.int32) // 32, 3) is None
    with pytest.raises(ValueError, match="group_size 48 does not cut 128 inputs into 4 groups"):
        w4a16_gemm(torch.randn(8, 128), qweight, qzeros, s, g_idx, group_size=48)


def test_w4a16_tables_per_architecture_and_m():
    for cap in (SM80, SM90):
        small, _ = gemm_config(cap, 16, 4096, 4096, 128)
        large, _ = gemm_config(cap, 4096, 4096, 4096, 128)
        assert small.block_m == 16 and small.block_k >= 64 and small.block_n >= 64
        assert (large.block_m, large.block_n, large.num_warps) == (128, 128, 8)
    assert gemm_config(SM90, 4096, 4096, 4096, 128)[0].num_stages > gemm_config(SM80, 4096, 4096, 4096, 128)[0].num_stages
    assert gemm_config(SM80, 40, 4096, 4096)[0] != gemm_config(SM90, 40, 4096, 4096)[0]
    # group smaller than the table's K step: the step shrinks so it stays inside one group
    cfg, group = gemm_config(SM90, 16, 4096, 4096, 32)
    assert (cfg.block_k, group) == (32, 32)
    # a group no power of two >= 16 divides (act-order-like handling): gathered through g_idx
    assert gemm_config(SM90, 16, 4096, 4096, 40)[1] == 0
    # float32 activations (an FMA dot, operands in registers) keep the small tiles: the table's spill
    fp32, _ = gemm_config(SM90, 4096, 4096, 4096, 128, fp32=True)
    assert fp32.block_m <= 64 and fp32.block_n <= 32 and fp32.num_warps == 4
    # GEMV: split-K fills more programs on the GPU with more SMs
    gemv80, _ = gemv_config(SM80, 1, 4096, 4096, 128)
    gemv90, _ = gemv_config(SM90, 1, 4096, 4096, 128)
    assert gemv90.split_k > gemv80.split_k and gemv80.block_m == 1
    assert gemv_config(SM80, 4, 4096, 4096, 128)[0].block_m == 4


# -- fp8 needs sm_89+: refused at load, naming method, key and capability --------------------------

def fp8_layer(kernel: str):
    from lmplug_quant.fp8 import FP8, FP8Options

    method = FP8(FP8Options(kernel=kernel))
    layer = torch.nn.Module()
    method.create_weights(layer, 64, 32, torch.float32, bias=False)
    layer.weight.data.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)))
    return method, layer


def test_fp8_triton_on_sm80_is_refused_at_load():
    method, layer = fp8_layer("triton")
    with target_capability(SM80), pytest.raises(ModelLoadError) as info:
        method.process_weights_after_loading(layer)
    msg = str(info.value)
    assert "'fp8'" in msg and "`kernel: triton`" in msg and "8.9" in msg
    assert "sm_80 (compute capability 8.0)" in msg


def test_fp8_triton_on_sm90_and_auto_on_sm80():
    method, layer = fp8_layer("triton")
    with target_capability(SM90):
        method.process_weights_after_loading(layer)
    assert layer.path == "triton"
    method, layer = fp8_layer("auto")  # auto never refuses: on CPU it takes the PyTorch path
    with target_capability(SM80):
        method.process_weights_after_loading(layer)
    assert layer.path != "triton"
