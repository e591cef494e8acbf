"""The ``flash`` Triton kernels against the PyTorch references (``decode_ref``, ``prefill_ref``),
and the references against plain float64 math.

Kernels run on ``support.devices.kernel_device()``: the CPU under ``TRITON_INTERPRET=1`` (set by
conftest.py without a GPU) at small sizes, or compiled on a CUDA GPU.
Every output buffer starts as NaN, so an element the kernel forgets to write
fails the comparison; every cache slot outside a sequence's visible keys is
NaN too, so a kernel that reads past the context, through block-table
padding, or behind the sliding window leaks NaN into its result.
bf16 cases run only compiled, on CUDA sm_80+ (``TRITON_INTERPRET=0``): ``tl.dot`` on
bf16 operands is wrong under the interpreter (see docs/triton-on-cpu.md).
"""

from __future__ import annotations

import pytest
import torch
from lmplug_attention.decode_ops import MAX_SPLITS, choose_num_splits, plan_decode
from lmplug_attention.decode_ref import decode_attention
from lmplug_attention.flash.decode_kernels import flash_decode_with_kvcache
from lmplug_attention.flash.prefill_kernels import (
    flash_prefill_with_kvcache,
    flash_varlen_attention,
)
from lmplug_attention.prefill_ref import prefill_attention, varlen_attention
from support.devices import NO_KERNEL_DEVICE, bf16_param, kernel_device

# one device per run: the CPU under the interpreter, or CUDA compiled (conftest.py decides)
DEVICE = kernel_device()
if DEVICE is None:
    pytest.skip(NO_KERNEL_DEVICE, allow_module_level=True)
NAN = float("nan")
# (atol, rtol): kernel vs reference (both accumulate in fp32; fp16 P@V operands round P), reference vs float64
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
TOL64 = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
BF16 = bf16_param()
FP32 = pytest.param(torch.float32, id="fp32")
FP16 = pytest.param(torch.float16, id="fp16")


# -- building inputs ----------------------------------------------------------------------------------------

def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def first_visible(seq_len: int, query_len: int, window: int | None) -> int:
    """The earliest key position any of the sequence's queries sees."""
    return 0 if window is None else max(seq_len - query_len - window + 1, 0)


def make_cache(gen, seq_lens, query_lens, num_kv_heads, head_dim, dtype, layout, block_size, window=None):
    """Caches holding every sequence's keys; NaN in every slot no query may read.

    paged: ``block_size`` slots per block, block ids a random permutation;
    contiguous: one block (row) of ``block_size`` >= every seq_len per sequence,
    rows shuffled. Returns k_cache, v_cache, block_tables, keys, values (per
    sequence [S, Hkv, D], for the float64 check).
    """
    counts = [-(-s // block_size) for s in seq_lens] if layout == "paged" else [1] * len(seq_lens)
    if layout == "contiguous" and block_size < max(seq_lens):
        raise ValueError("contiguous: block_size must hold the longest sequence")
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    pad = order[-1]  # table padding points at a poisoned block
    tables, used = [], 0
    for n in counts:
        tables.append(order[used:used + n])
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, NAN, dtype=dtype, device=DEVICE)
    keys, values = [], []
    for table, seq_len, qlen in zip(tables, seq_lens, query_lens):
        k, v = (randn(gen, seq_len, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
        keys.append(k)
        values.append(v)
        for p in range(first_visible(seq_len, qlen, window), seq_len):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
    width = max(counts)
    block_tables = torch.tensor([t + [pad] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, block_tables, keys, values


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def lens_tensor(lens: list[int]) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def float64_attention(q, keys, values, query_lens, scale, window):
    """softmax(q k^T * scale + mask) v per sequence in float64, K/V heads repeated: the definition."""
    out, start = [], 0
    for k, v, qlen in zip(keys, values, query_lens):
        seq_len, group = k.shape[0], q.shape[1] // k.shape[1]
        qi = q[start:start + qlen].double().transpose(0, 1)  # [H, L, D]
        ki = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        vi = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = (qi @ ki.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ vi).transpose(0, 1))
        start += qlen
    return torch.cat(out)


def assert_close(actual, expected, tol):
    assert not torch.isnan(actual).any(), "the kernel left NaN in its output (unwritten rows or poisoned reads)"
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, NAN)


# -- the PyTorch references against the definition -------------------------------------------------------

@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(4, 4, 64, None), (8, 2, 80, 7), (8, 1, 32, 20)])
def test_refs_match_float64_definition(dtype, heads, kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    # varlen: no cached prefix
    lens = [9, 1, 40]
    q = randn(gen, sum(lens), heads, head_dim, dtype=dtype)
    k, v = (randn(gen, sum(lens), kv_heads, head_dim, dtype=dtype) for _ in range(2))
    cu = cu_of(lens)
    keys = [k[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    values = [v[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    got = varlen_attention(q, k, v, cu, scale, sliding_window=window)
    assert_close(got, float64_attention(q, keys, values, lens, scale, window), TOL64[dtype])
    # cached prefix, paged, and decode over the same caches
    seq_lens, qlens = [30, 7, 45], [12, 7, 1]
    kc, vc, bt, keys, values = make_cache(gen, seq_lens, qlens, kv_heads, head_dim, dtype, "paged", 8, window)
    q = randn(gen, sum(qlens), heads, head_dim, dtype=dtype)
    got = prefill_attention(q, kc, vc, bt, cu_of(qlens), lens_tensor(seq_lens), scale,
                                   sliding_window=window)
    assert_close(got, float64_attention(q, keys, values, qlens, scale, window), TOL64[dtype])
    kc, vc, bt, keys, values = make_cache(gen, seq_lens, [1, 1, 1], kv_heads, head_dim, dtype, "contiguous",
                                          48, window)
    q = randn(gen, 3, heads, head_dim, dtype=dtype)
    got = decode_attention(q, kc, vc, bt, lens_tensor(seq_lens), scale, sliding_window=window)
    assert_close(got, float64_attention(q, keys, values, [1, 1, 1], scale, window), TOL64[dtype])


# -- varlen prefill (packed K/V) ---------------------------------------------------------------------------

VARLEN_CASES = [
    # head_dim, heads, kv_heads, lens, window, block_m, block_n
    pytest.param(64, 2, 2, [33, 1, 64], None, 16, 16, id="d64-mha-diagonal-tiles"),
    pytest.param(80, 4, 1, [20, 45], None, 32, 16, id="d80-gqa4-pad128"),
    pytest.param(96, 8, 1, [17, 30], 9, 16, 16, id="d96-gqa8-window"),
    pytest.param(128, 4, 2, [50, 3], None, 32, 32, id="d128-gqa2"),
    pytest.param(256, 2, 1, [24, 9], None, 16, 16, id="d256"),
    pytest.param(64, 2, 1, [96], 16, 16, 16, id="window-equals-tile"),
    pytest.param(64, 2, 1, [90, 40], 37, 16, 16, id="window-spans-tiles"),
    pytest.param(64, 2, 2, [70], 5, 32, 16, id="window-below-tile"),
    pytest.param(64, 2, 2, [40, 25], None, None, None, id="default-tiles"),
]


@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("head_dim,heads,kv_heads,lens,window,block_m,block_n", VARLEN_CASES)
def test_varlen_prefill_matches_ref(dtype, head_dim, heads, kv_heads, lens, window, block_m, block_n):
    gen = torch.Generator().manual_seed(1)
    q = randn(gen, sum(lens), heads, head_dim, dtype=dtype)
    k, v = (randn(gen, sum(lens), kv_heads, head_dim, dtype=dtype) for _ in range(2))
    cu, scale = cu_of(lens), head_dim ** -0.5
    out = flash_varlen_attention(q, k, v, cu, scale, sliding_window=window, out=nan_like(q),
                                 block_m=block_m, block_n=block_n)
    assert_close(out, varlen_attention(q, k, v, cu, scale, sliding_window=window), TOL[dtype])


@pytest.mark.parametrize("dtype", [BF16])
def test_varlen_prefill_bf16(dtype):
    gen = torch.Generator().manual_seed(1)
    lens = [40, 7]
    q = randn(gen, sum(lens), 4, 128, dtype=dtype)
    k, v = (randn(gen, sum(lens), 1, 128, dtype=dtype) for _ in range(2))
    out = flash_varlen_attention(q, k, v, cu_of(lens), 0.1, sliding_window=16, out=nan_like(q))
    assert_close(out, varlen_attention(q, k, v, cu_of(lens), 0.1, sliding_window=16), TOL[dtype])


def test_varlen_first_seq_leaves_earlier_rows_alone():
    gen = torch.Generator().manual_seed(2)
    lens = [1, 1, 20]
    q = randn(gen, 22, 2, 64, dtype=torch.float32)
    k, v = (randn(gen, 22, 2, 64, dtype=torch.float32) for _ in range(2))
    out = flash_varlen_attention(q, k, v, cu_of(lens), 0.125, first_seq=2, out=nan_like(q), block_m=16)
    assert torch.isnan(out[:2]).all()
    assert_close(out[2:], varlen_attention(q, k, v, cu_of(lens), 0.125)[2:], TOL[torch.float32])


# -- prefill over cached K/V (chunked prefill, prefix hits) ------------------------------------------------

CACHED_CASES = [
    # layout, block_size, block_n, heads, kv_heads, head_dim, query_lens, context_lens, window
    pytest.param("paged", 16, 32, 4, 1, 64, [1, 20, 37], [30, 0, 17], None, id="paged-bs16-gather"),
    pytest.param("paged", 32, 16, 8, 1, 64, [12, 30], [45, 2], None, id="paged-bs32-one-block-per-tile"),
    pytest.param("paged", 8, 16, 4, 2, 96, [25, 6], [40, 60], 13, id="paged-bs8-window"),
    pytest.param("contiguous", 80, 16, 4, 4, 64, [16, 33], [50, 0], None, id="contiguous-80"),
    pytest.param("contiguous", 72, 16, 4, 1, 80, [10, 40], [60, 20], 24, id="contiguous-72-window"),
    pytest.param("paged", 16, 16, 2, 1, 256, [9, 20], [20, 0], None, id="paged-d256"),
]


@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("layout,block_size,block_n,heads,kv_heads,head_dim,query_lens,context_lens,window",
                         CACHED_CASES)
def test_cached_prefill_matches_ref(dtype, layout, block_size, block_n, heads, kv_heads, head_dim,
                                    query_lens, context_lens, window):
    gen = torch.Generator().manual_seed(3)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    kc, vc, bt, keys, values = make_cache(gen, seq_lens, query_lens, kv_heads, head_dim, dtype, layout,
                                          block_size, window)
    q = randn(gen, sum(query_lens), heads, head_dim, dtype=dtype)
    cu, sl, scale = cu_of(query_lens), lens_tensor(seq_lens), head_dim ** -0.5
    out = flash_prefill_with_kvcache(q, kc, vc, bt, cu, sl, scale, sliding_window=window, out=nan_like(q),
                                     block_m=16, block_n=block_n)
    ref = prefill_attention(q, kc, vc, bt, cu, sl, scale, sliding_window=window)
    assert_close(out, ref, TOL[dtype])
    if dtype == torch.float32:
        assert_close(ref, float64_attention(q, keys, values, query_lens, scale, window), TOL64[dtype])


@pytest.mark.parametrize("dtype", [BF16])
def test_cached_prefill_bf16(dtype):
    gen = torch.Generator().manual_seed(3)
    qlens, seq_lens = [20, 5], [50, 5]
    kc, vc, bt, _, _ = make_cache(gen, seq_lens, qlens, 2, 128, dtype, "paged", 16)
    q = randn(gen, 25, 8, 128, dtype=dtype)
    out = flash_prefill_with_kvcache(q, kc, vc, bt, cu_of(qlens), lens_tensor(seq_lens), 0.09, out=nan_like(q))
    ref = prefill_attention(q, kc, vc, bt, cu_of(qlens), lens_tensor(seq_lens), 0.09)
    assert_close(out, ref, TOL[dtype])


# -- decode (flash decoding) --------------------------------------------------------------------------------

DECODE_CASES = [
    # layout, block_size, heads, kv_heads, head_dim, seq_lens, window, num_splits
    pytest.param("paged", 16, 4, 4, 64, [100, 1, 37, 64], None, 1, id="mha-no-split"),
    pytest.param("paged", 16, 4, 4, 64, [100, 1, 37, 64], None, 4, id="mha-split4"),
    pytest.param("paged", 8, 8, 2, 80, [150, 33], None, 3, id="gqa4-d80-split3-gather"),
    pytest.param("contiguous", 208, 8, 1, 128, [200, 5, 90], None, 5, id="gqa8-contiguous-split5"),
    pytest.param("contiguous", 208, 8, 1, 128, [200, 5, 90], None, 1, id="gqa8-contiguous-no-split"),
    pytest.param("paged", 32, 4, 2, 96, [180, 20], 40, 2, id="window-split2"),
    pytest.param("paged", 16, 4, 1, 256, [70, 9], 30, None, id="d256-window-auto"),
    pytest.param("contiguous", 64, 2, 1, 64, [64, 63, 2], 16, 1, id="window-no-split"),
]


@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("layout,block_size,heads,kv_heads,head_dim,seq_lens,window,num_splits", DECODE_CASES)
def test_decode_matches_ref(dtype, layout, block_size, heads, kv_heads, head_dim, seq_lens, window, num_splits):
    gen = torch.Generator().manual_seed(4)
    batch = len(seq_lens)
    kc, vc, bt, keys, values = make_cache(gen, seq_lens, [1] * batch, kv_heads, head_dim, dtype, layout,
                                          block_size, window)
    q = randn(gen, batch, heads, head_dim, dtype=dtype)
    sl, scale = lens_tensor(seq_lens), head_dim ** -0.5
    out = flash_decode_with_kvcache(q, kc, vc, bt, sl, scale, sliding_window=window, num_splits=num_splits,
                                    out=nan_like(q), block_n=16)
    ref = decode_attention(q, kc, vc, bt, sl, scale, sliding_window=window)
    assert_close(out, ref, TOL[dtype])
    if dtype == torch.float32:
        assert_close(ref, float64_attention(q, keys, values, [1] * batch, scale, window), TOL64[dtype])


@pytest.mark.parametrize("dtype", [BF16])
def test_decode_bf16(dtype):
    gen = torch.Generator().manual_seed(4)
    seq_lens = [300, 17]
    kc, vc, bt, _, _ = make_cache(gen, seq_lens, [1, 1], 2, 128, dtype, "paged", 16)
    q = randn(gen, 2, 8, 128, dtype=dtype)
    for splits in (1, 3):
        out = flash_decode_with_kvcache(q, kc, vc, bt, lens_tensor(seq_lens), 0.09, num_splits=splits,
                                        out=nan_like(q))
        assert_close(out, decode_attention(q, kc, vc, bt, lens_tensor(seq_lens), 0.09), TOL[dtype])


def test_split_plan():
    # few programs and a long context: split; a full GPU or a short context: don't
    assert choose_num_splits(1, 8, 16384, 132) > 1
    assert choose_num_splits(64, 8, 16384, 132) == 1
    assert choose_num_splits(1, 8, 300, 132) == 1
    assert choose_num_splits(1, 1, 10**6, 132) == MAX_SPLITS
    # partitions are whole tiles and cover the span; a window bounds the span, not the context
    splits, part = plan_decode(2, 8, 16384, None, 64, None, 132)
    assert splits > 1 and part % 64 == 0 and splits * part >= 16384 > (splits - 1) * part
    splits, part = plan_decode(2, 8, 16384, 1000, 64, None, 132)
    assert splits * part >= 1000 + 63 and part >= 256
    assert plan_decode(2, 8, 16384, None, 64, 1, 132) == (1, 16384)
    assert plan_decode(1, 1, 40, None, 16, 8, 132) == (3, 16)  # asked 8, but only 3 tiles of work


def test_backend_split_option_matches_kernel_limit():
    from lmplug_attention.flash.backend import MAX_SPLITS as option_limit

    assert option_limit == MAX_SPLITS


# -- argument checks ---------------------------------------------------------------------------------------

def test_bad_arguments_raise_value_errors():
    q = torch.zeros(5, 4, 64)
    k = torch.zeros(5, 2, 64)
    cu = cu_of([5])
    with pytest.raises(ValueError, match="dtype"):
        flash_varlen_attention(q, k.half(), k.half(), cu, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_varlen_attention(q, torch.zeros(5, 3, 64), torch.zeros(5, 3, 64), cu, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        flash_varlen_attention(q, k, k, cu.long(), 0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        flash_varlen_attention(q, k, k, cu, 0.1, sliding_window=0)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        flash_varlen_attention(q, k, k, cu, 0.1, block_m=24)
    cache = torch.zeros(4, 16, 2, 64)
    tables, seq_lens = torch.zeros(1, 2, dtype=torch.int32), lens_tensor([5])
    with pytest.raises(ValueError, match="block_tables and seq_lens must be int32"):
        flash_prefill_with_kvcache(q, cache, cache, tables.long(), cu, seq_lens, 0.1)
    with pytest.raises(ValueError, match="out must be shaped"):
        flash_prefill_with_kvcache(q, cache, cache, tables, cu, seq_lens, 0.1, out=torch.zeros(5, 4, 32))
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode_with_kvcache(q[:1], cache, cache, tables, seq_lens, 0.1, num_splits=0)
    with pytest.raises(ValueError, match="head_dim"):
        flash_decode_with_kvcache(torch.zeros(1, 4, 32), cache, cache, tables, seq_lens, 0.1)
