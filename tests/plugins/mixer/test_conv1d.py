"""Causal depthwise conv1d with a carried state: the reference against transformers, the Triton kernels against it.

Ground truth: transformers' Mamba2 conv functions (``causal_conv1d_fn`` on the
cached inputs followed by the new tokens, as ``Mamba2Mixer`` runs it, and
``causal_conv1d_update``). Its cache keeps K columns where ours keeps K-1, so
its state is ours behind one extra (random, never read) oldest column. Then:
chunks carried one after another equal one pass, decode steps equal the
prefill, and the kernels (on ``kernel_device``) equal the reference. Each op on a
pool of state slots (``state_indices``, slots shuffled, more slots than
sequences) equals it on the gathered per-batch states, leaving other slots
bit-identical.
Tolerance fp32: atol = rtol = 1e-5 (the sums are K terms).
"""

from __future__ import annotations

import pytest
import torch
from lmplug_mixer import conv1d_kernels, conv1d_ref
from support.state_pools import others, pool_with
from transformers.models.mamba2 import modeling_mamba2 as hf

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def inputs(lens: list[int], channels: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), channels, generator=g)
    weight = torch.randn(channels, width, generator=g) / width ** 0.5
    bias = torch.randn(channels, generator=g)
    state = torch.randn(len(lens), channels, width - 1, generator=g)
    return x, weight, bias, state


@pytest.mark.parametrize("lens", [[7], [1, 5, 12], [2, 3, 9, 1]])
@pytest.mark.parametrize("carried", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_reference_equals_transformers(lens, carried, activation):
    width = 4
    x, weight, bias, state = inputs(lens, 10, width)
    conv_state = state if carried else None
    y, new_state = conv1d_ref.causal_conv1d(x, weight, bias, cu_of(lens), conv_state, activation)
    cu = cu_of(lens).tolist()
    for i, n in enumerate(lens):
        seq = x[cu[i]:cu[i + 1]].T[None]  # [1, C, L]
        if carried:  # the mixer's cached prefill: conv over [cache (K columns); tokens], last L kept
            hf_state = torch.cat([torch.randn(1, 10, 1), state[i:i + 1]], dim=2)
            seq = torch.cat([hf_state, seq], dim=2)
        expected = hf.causal_conv1d_fn(seq, weight, bias, activation=activation)[0, :, -n:].T
        torch.testing.assert_close(y[cu[i]:cu[i + 1]], expected, **TOL[torch.float32])
        # what the mixer's cache keeps after the prefill (zeros before a fresh sequence),
        # less its oldest column
        kept = torch.nn.functional.pad(seq, (width, 0))[0, :, -(width - 1):]
        torch.testing.assert_close(new_state[i], kept, atol=0, rtol=0)


@pytest.mark.parametrize("pieces", [[[3, 4], [1, 1, 5]], [[1, 2, 6], [9]]])
def test_chunked_prefill_equals_one_pass(pieces):
    """Each sequence in pieces (shorter than K-1 too), state carried: the same outputs and state."""
    lens = [sum(p) for p in pieces]
    x, weight, bias, state = inputs(lens, 6, 4, seed=1)
    y, final = conv1d_ref.causal_conv1d(x, weight, bias, cu_of(lens), state)
    cu = cu_of(lens).tolist()
    for i, parts in enumerate(pieces):
        carried, start = state[i:i + 1], cu[i]
        for n in parts:
            out, carried = conv1d_ref.causal_conv1d(x[start:start + n], weight, bias, cu_of([n]), carried)
            torch.testing.assert_close(out, y[start:start + n], **TOL[torch.float32])
            start += n
        torch.testing.assert_close(carried[0], final[i], atol=0, rtol=0)


def test_update_steps_equal_prefill_and_transformers():
    batch, steps, width = 3, 6, 4
    x, weight, bias, state = inputs([steps] * batch, 8, width, seed=2)
    tokens = x.view(batch, steps, 8)
    y, final = conv1d_ref.causal_conv1d(x, weight, bias, cu_of([steps] * batch), state)
    ours, theirs = state.clone(), state.clone()
    for t in range(steps):
        out = conv1d_ref.causal_conv1d_update(tokens[:, t], ours, weight, bias, "silu")
        expected = hf.causal_conv1d_update(tokens[:, t, :, None], theirs, weight, bias, "silu")[..., 0]
        torch.testing.assert_close(out, expected, **TOL[torch.float32])
        torch.testing.assert_close(out, y.view(batch, steps, 8)[:, t], **TOL[torch.float32])
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    torch.testing.assert_close(ours, final, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens,channels,width", [([1, 5, 20], 70, 4), ([3, 0, 17], 24, 2), ([2, 9], 12, 5),
                                                 ([30, 7, 40], 20, 4)])
@pytest.mark.parametrize("carried", [False, True])
def test_kernel_equals_reference(lens, channels, width, carried, dtype, kernel_device):
    """Tiles straddling sequences (77 tokens: several token tiles), sequences shorter than K-1 or
    empty, channels past one tile; x a strided view (a slice of a wider projection, as Mamba2 splits
    its xBC)."""
    x, weight, bias, state = (t.to(kernel_device, dtype) for t in inputs(lens, channels + 3, width))
    x, weight, bias, state = x[:, 2:channels + 2], weight[:channels], bias[:channels], state[:, :channels]
    cu = cu_of(lens).to(kernel_device, torch.int64 if carried else torch.int32)  # both index types
    conv_state = state if carried else None
    expected = conv1d_ref.causal_conv1d(x, weight, bias, cu, conv_state)
    got = conv1d_kernels.causal_conv1d(x, weight, bias, cu, conv_state)
    torch.testing.assert_close(got[0], expected[0], **TOL[dtype])
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels,width,with_bias", [(70, 4, True), (12, 2, False), (20, 5, True)])
def test_update_kernel_equals_reference(channels, width, with_bias, dtype, kernel_device):
    x, weight, bias, state = (t.to(kernel_device, dtype) for t in inputs([1] * 3, channels, width, seed=3))
    bias = bias if with_bias else None
    ours, theirs = state.clone(), state.clone()
    for activation in ("silu", None):
        expected = conv1d_ref.causal_conv1d_update(x, theirs, weight, bias, activation)
        got = conv1d_kernels.causal_conv1d_update(x, ours, weight, bias, activation)
        torch.testing.assert_close(got, expected, **TOL[dtype])
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_bad_arguments_are_refused():
    x, weight, bias, state = inputs([4], 6, 4)
    with pytest.raises(ValueError, match="activation"):
        conv1d_ref.causal_conv1d(x, weight, bias, cu_of([4]), state, activation="gelu")
    with pytest.raises(ValueError, match=r"conv_state must be \[B, C, K-1\]"):
        conv1d_kernels.causal_conv1d(x, weight, bias, cu_of([4]), torch.zeros(1, 6, 4))


# -- a pool of state slots ------------------------------------------------------------------------------


def check_pool_prefill(ops, device: str, index_dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    lens = [5, 1, 0, 12]  # shorter than K-1 and empty: new states partly from the old ones
    x, weight, bias, state = (t.to(device) for t in inputs(lens, 70, 4, seed=4))
    state = state.to(state_dtype)
    cu = cu_of(lens).to(device)
    y, new_state = ops.causal_conv1d(x, weight, bias, cu, state)
    slots, pool = pool_with(state, 9, index_dtype, seed=5)
    before = pool.clone()
    y_pool, returned = ops.causal_conv1d(x, weight, bias, cu, pool, state_indices=slots)
    assert returned is None
    torch.testing.assert_close(y_pool, y, atol=0, rtol=0)
    torch.testing.assert_close(pool[slots.long()], new_state, atol=0, rtol=0)
    torch.testing.assert_close(others(pool, slots), others(before, slots), atol=0, rtol=0)


def check_pool_update(ops, device: str, index_dtype: torch.dtype) -> None:
    x, weight, bias, state = (t.to(device) for t in inputs([1] * 3, 70, 4, seed=6))
    slots, pool = pool_with(state, 7, index_dtype, seed=7)
    before = pool.clone()
    for step in range(2):
        expected = ops.causal_conv1d_update(x + step, state, weight, bias)
        got = ops.causal_conv1d_update(x + step, pool, weight, bias, state_indices=slots)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        torch.testing.assert_close(pool[slots.long()], state, atol=0, rtol=0)
    torch.testing.assert_close(others(pool, slots), others(before, slots), atol=0, rtol=0)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_reference_on_a_state_pool(index_dtype):
    check_pool_prefill(conv1d_ref, "cpu", index_dtype, torch.float32)
    check_pool_update(conv1d_ref, "cpu", index_dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernels_on_a_state_pool(index_dtype, kernel_device):
    check_pool_prefill(conv1d_kernels, kernel_device, index_dtype, torch.float32)
    check_pool_update(conv1d_kernels, kernel_device, index_dtype)


def test_kernel_keeps_an_fp32_state_of_16_bit_inputs(kernel_device):
    """The state in fp32 beside fp16 x (a cache may keep states wider than the activations): the old
    columns a short sequence keeps come through unrounded."""
    lens = [1, 2, 9]
    x, weight, bias, state = (t.to(kernel_device) for t in inputs(lens, 20, 4, seed=8))
    x, weight, bias = x.half(), weight.half(), bias.half()
    cu = cu_of(lens).to(kernel_device)
    y, expected = conv1d_ref.causal_conv1d(x, weight, bias, cu, state)
    got_y, got = conv1d_kernels.causal_conv1d(x, weight, bias, cu, state)
    torch.testing.assert_close(got_y, y, **TOL[torch.float16])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_state_indices_are_checked():
    x, weight, bias, state = inputs([4, 2], 6, 4)
    for ops in (conv1d_ref, conv1d_kernels):
        with pytest.raises(ValueError, match="needs the state pool"):
            ops.causal_conv1d(x, weight, bias, cu_of([4, 2]), None, state_indices=torch.tensor([0, 1]))
        with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[B\] = \[2\]"):
            ops.causal_conv1d_update(x[:2], state, weight, bias, state_indices=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"conv_state must be the pool \[num_slots, C, K-1\]"):
        conv1d_kernels.causal_conv1d(x, weight, bias, cu_of([4, 2]), torch.zeros(5, 6, 4),
                                     state_indices=torch.tensor([3, 1]))
