"""The gated delta rule (Qwen3-Next): the PyTorch reference against transformers, the Triton kernels
against the reference.

Ground truth: transformers' own ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule``
(their torch code, not a hub kernel), which take a padded batch ``[B, S, H, D]``: they run each
sequence alone, and our flattened varlen results are compared per sequence. ``Qwen3NextGatedDeltaNet``
with our chunked rule swapped in for theirs must give the layer's own output. Then: the chunked form
equals the plain recurrence, a prefill cut into pieces carrying the state equals one pass, and T decode
steps equal the prefill over the same T tokens. The kernels (``kernel_device``: the CPU under
``TRITON_INTERPRET=1``, or compiled on a GPU) are compared with the reference on small shapes.

Inputs: gates as Qwen3-Next makes them (``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta =
sigmoid(b)``), with A in [0.05, 1] rather than the model's init range [0.01, 16] so that the state
decays slowly and the carried state matters; non-zero initial states; grouped heads (Hv = 2 Hk).
Tolerances, fp32: 1e-5 absolute and relative (outputs and states are O(1)).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from lmplug_mixer import delta_kernels, delta_ref
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf

FP32 = {"atol": 1e-5, "rtol": 1e-5}
TOL = {torch.float32: FP32, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 1.5e-2, "rtol": 1.5e-2}}
# the torch code under transformers' hub-kernel decorator (it would call FLA where installed)
HF_CHUNK = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
HF_RECURRENT = getattr(hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule)


class Case:
    """Flattened sequences of ``lens`` tokens: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], and
    an initial state [B, Hv, Dk, Dv] (None when ``fresh``)."""

    def __init__(self, lens, *, hk=2, hv=4, dk=8, dv=12, fresh=False, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        total = sum(lens)
        self.lens = list(lens)
        self.cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        self.q, self.k = (torch.randn(total, hk, dk, generator=gen).to(dtype) for _ in range(2))
        self.v = torch.randn(total, hv, dv, generator=gen).to(dtype)
        a_log = (torch.rand(hv, generator=gen) * 0.95 + 0.05).log()
        dt_bias = torch.randn(hv, generator=gen)
        a, b = torch.randn(total, hv, generator=gen), torch.randn(total, hv, generator=gen)
        self.g = -a_log.exp() * F.softplus(a + dt_bias)
        self.beta = b.sigmoid().to(dtype)
        batch = len(lens)
        self.state = None if fresh else torch.randn(batch, hv, dk, dv, generator=gen) * 0.5

    def args(self, rows=slice(None), seqs=slice(None), state=None):
        """The rule's positional arguments for tokens ``rows`` (one sequence: ``seqs``)."""
        cu = self.cu_seqlens if rows == slice(None) else torch.tensor([0, rows.stop - rows.start])
        init = self.state[seqs] if state is None and self.state is not None else state
        return (self.q[rows], self.k[rows], self.v[rows], self.g[rows], self.beta[rows], cu, init)

    def seq(self, b: int) -> slice:
        return slice(int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1]))


def transformers_per_sequence(case: Case, chunk_size: int | None):
    """transformers' rule run on each sequence alone ([1, S, H, D]): (o [T, Hv, Dv], states [B, ...])."""
    outs, states = [], []
    for b in range(len(case.lens)):
        rows = case.seq(b)
        args = [x[rows][None] for x in (case.q, case.k, case.v, case.g, case.beta)]
        init = None if case.state is None else case.state[b:b + 1]
        kw = {"initial_state": init, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        if chunk_size is None:
            o, s = HF_RECURRENT(*args, **kw)
        else:
            o, s = HF_CHUNK(*args, chunk_size=chunk_size, **kw)
        outs.append(o[0])
        states.append(s[0])
    return torch.cat(outs), torch.stack(states)


CASES = {
    "grouped-varlen-c16": ({"lens": [5, 17, 40, 33]}, 16),
    "mha-fresh-c64": ({"lens": [70, 1, 64], "hk": 2, "hv": 2, "dk": 16, "dv": 16, "fresh": True}, 64),
    "wide-key-c32": ({"lens": [3, 32, 45], "hk": 1, "hv": 3, "dk": 32, "dv": 8}, 32),
}


@pytest.mark.parametrize("name", CASES)
def test_chunk_matches_transformers(name):
    spec, chunk = CASES[name]
    case = Case(**spec)
    o, state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=chunk)
    want_o, want_state = transformers_per_sequence(case, chunk)
    torch.testing.assert_close(o, want_o, **FP32)
    torch.testing.assert_close(state, want_state, **FP32)


@pytest.mark.parametrize("name", CASES)
def test_recurrence_matches_transformers(name):
    case = Case(**CASES[name][0])
    o, state = delta_ref.recurrent_gated_delta_rule(*case.args())
    want_o, want_state = transformers_per_sequence(case, None)
    torch.testing.assert_close(o, want_o, **FP32)
    torch.testing.assert_close(state, want_state, **FP32)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_form_equals_recurrence(chunk):
    case = Case([5, 17, 0, 40, 33], seed=1)
    o, state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=chunk)
    want_o, want_state = delta_ref.recurrent_gated_delta_rule(*case.args())
    torch.testing.assert_close(o, want_o, **FP32)
    torch.testing.assert_close(state, want_state, **FP32)


def test_unnormalized_with_scale():
    """use_qk_l2norm=False and an explicit scale (small keys keep the delta rule contracting)."""
    case = Case([9, 23], seed=2)
    case.k = case.k * 0.3
    kw = {"use_qk_l2norm": False, "scale": 0.7}
    o, state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=16, **kw)
    want_o, want_state = delta_ref.recurrent_gated_delta_rule(*case.args(), **kw)
    torch.testing.assert_close(o, want_o, **FP32)
    torch.testing.assert_close(state, want_state, **FP32)


def pieces_prefill(rule, case: Case, cuts, **kw):
    """Each sequence's tokens in pieces (``cuts``: where each sequence's prefix ends), the state of one
    piece the initial state of the next: (o [T, Hv, Dv], final states [B, ...])."""
    outs, states = [], []
    for b, points in enumerate(cuts):
        rows = case.seq(b)
        state = case.state[b:b + 1]
        bounds = [rows.start, *(rows.start + p for p in points), rows.stop]
        for lo, hi in itertools.pairwise(bounds):
            o, state = rule(*case.args(slice(lo, hi), state=state), **kw)
            outs.append(o)
        states.append(state)
    return torch.cat(outs), torch.cat(states)


def test_chunked_prefill_carries_state():
    case = Case([40, 33, 21], seed=3)
    want_o, want_state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=16)
    o, state = pieces_prefill(delta_ref.chunk_gated_delta_rule, case, [[16, 35], [7], [1, 2]], chunk_size=16)
    torch.testing.assert_close(o, want_o, **FP32)
    torch.testing.assert_close(state, want_state, **FP32)


def decode_steps(update, case: Case, steps: int, **kw):
    """``steps`` decode steps of every sequence (token t of each at step t): (o [B, steps, ...], state)."""
    state = case.state.clone()
    rows = case.cu_seqlens[:-1].long()
    outs = []
    for t in range(steps):
        at = rows + t
        outs.append(update(case.q[at], case.k[at], case.v[at], case.g[at], case.beta[at], state, **kw))
    return torch.stack(outs, dim=1), state


def test_decode_steps_equal_prefill():
    case = Case([12, 12, 12], seed=4)
    want_o, want_state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=16)
    o, state = decode_steps(delta_ref.fused_recurrent_gated_delta_rule_update, case, 12)
    torch.testing.assert_close(o.flatten(0, 1), want_o, **FP32)
    torch.testing.assert_close(state, want_state, **FP32)


def test_swapped_into_the_transformers_layer(monkeypatch):
    """Qwen3NextGatedDeltaNet's forward with our rule in place of transformers' gives its own output:
    our API takes the layer's q/k/v/g/beta as they are (grouped heads, l2norm, scale)."""
    config = Qwen3NextConfig(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                             num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(5)
    layer = hf.Qwen3NextGatedDeltaNet(config, 0).eval()
    hidden = torch.randn(2, 37, 32)
    with torch.no_grad():
        want = layer(hidden)

    def ours(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **_):
        batch, length = query.shape[:2]
        cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
        o, state = delta_ref.chunk_gated_delta_rule(
            *(x.flatten(0, 1) for x in (query, key, value, g, beta)), cu, initial_state,
            use_qk_l2norm=use_qk_l2norm_in_kernel)
        return o.reshape(batch, length, *o.shape[1:]), state if output_final_state else None

    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", ours)
    with torch.no_grad():
        got = layer(hidden)
    torch.testing.assert_close(got, want, **FP32)


# -- the Triton kernels against the reference (interpreter: small shapes) -------------------------

KERNEL_CASES = {
    # two value slices (block_v 16 < Dv 20), head dims not powers of two, an empty sequence
    "grouped-varlen": ({"lens": [5, 17, 0, 33], "hk": 1, "hv": 2, "dk": 12, "dv": 20}, 16, 16),
    "fresh-one-seq": ({"lens": [40], "hk": 1, "hv": 1, "dk": 16, "dv": 16, "fresh": True}, 32, None),
    # key dims over several product tiles (16 and 32 lanes) with a partial last one; a sequence of
    # exactly one chunk, an empty one between others (chunk bookkeeping of the three prefill launches)
    "multi-tile": ({"lens": [33, 16, 0, 5], "hk": 1, "hv": 2, "dk": 40, "dv": 24}, 16, 16),
}


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_chunk_kernel_matches_reference(name, kernel_device):
    spec, chunk, block_v = KERNEL_CASES[name]
    case = Case(**spec)
    want_o, want_state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=chunk)
    args = [None if x is None else x.to(kernel_device) for x in case.args()]
    o, state = delta_kernels.chunk_gated_delta_rule(*args, chunk_size=chunk, block_v=block_v)
    torch.testing.assert_close(o.cpu(), want_o, **FP32)
    torch.testing.assert_close(state.cpu(), want_state, **FP32)


def test_chunk_kernel_unnormalized_int64_offsets(kernel_device):
    case = Case([9, 23], hk=1, hv=2, dk=16, dv=16, seed=2)
    case.k = case.k * 0.3
    kw = {"use_qk_l2norm": False, "scale": 0.7, "chunk_size": 16}
    want_o, want_state = delta_ref.chunk_gated_delta_rule(*case.args(), **kw)
    q, k, v, g, beta, cu, init = (x.to(kernel_device) for x in case.args())
    o, state = delta_kernels.chunk_gated_delta_rule(q, k, v, g, beta, cu.long(), init, **kw)
    torch.testing.assert_close(o.cpu(), want_o, **FP32)
    torch.testing.assert_close(state.cpu(), want_state, **FP32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_chunk_kernel_16bit(dtype, kernel_device):
    """16-bit inputs (loaded, then fp32 throughout: no 16-bit tl.dot, so bf16 runs interpreted too)."""
    case = Case([7, 20], hk=1, hv=2, dk=16, dv=16, dtype=dtype, seed=6)
    want_o, want_state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=16)
    args = [x.to(kernel_device) for x in case.args()]
    o, state = delta_kernels.chunk_gated_delta_rule(*args, chunk_size=16)
    assert o.dtype == dtype and state.dtype == torch.float32
    torch.testing.assert_close(o.cpu(), want_o, **TOL[dtype])
    torch.testing.assert_close(state.cpu(), want_state, **TOL[dtype])


def test_chunk_kernel_carries_state(kernel_device):
    case = Case([20, 9], hk=1, hv=2, dk=16, dv=16, seed=7)
    want_o, want_state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=16)
    for name in ("q", "k", "v", "g", "beta", "state", "cu_seqlens"):
        setattr(case, name, getattr(case, name).to(kernel_device))
    o, state = pieces_prefill(delta_kernels.chunk_gated_delta_rule, case, [[3, 18], [8]], chunk_size=16)
    torch.testing.assert_close(o.cpu(), want_o, **FP32)
    torch.testing.assert_close(state.cpu(), want_state, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_decode_kernel_matches_reference(dtype, kernel_device):
    case = Case([1, 1, 1], hk=2, hv=4, dk=12, dv=20, dtype=dtype, seed=8)
    q, k, v, g, beta, _, state = case.args()
    want_state = state.clone()
    want = delta_ref.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, want_state)
    dev = [x.to(kernel_device) for x in (q, k, v, g, beta, state)]
    got = delta_kernels.fused_recurrent_gated_delta_rule_update(*dev, block_v=16)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    torch.testing.assert_close(dev[-1].cpu(), want_state, **FP32)  # in place, fp32 math on both sides


def test_decode_kernel_steps_equal_prefill(kernel_device):
    case = Case([10, 10], hk=1, hv=2, dk=16, dv=16, seed=9)
    want_o, want_state = delta_ref.chunk_gated_delta_rule(*case.args(), chunk_size=16)
    for name in ("q", "k", "v", "g", "beta", "state", "cu_seqlens"):
        setattr(case, name, getattr(case, name).to(kernel_device))
    o, state = decode_steps(delta_kernels.fused_recurrent_gated_delta_rule_update, case, 10)
    torch.testing.assert_close(o.flatten(0, 1).cpu(), want_o, **FP32)
    torch.testing.assert_close(state.cpu(), want_state, **FP32)


def test_kernel_arguments_checked():
    case = Case([4, 4], hk=1, hv=2, dk=16, dv=16)
    with pytest.raises(ValueError, match="chunk_size"):
        delta_kernels.chunk_gated_delta_rule(*case.args(), chunk_size=24)
    with pytest.raises(ValueError, match="initial_state"):
        delta_kernels.chunk_gated_delta_rule(*case.args()[:-1], case.state.double())
    with pytest.raises(ValueError, match="multiple"):  # 3 value heads over 2 key heads
        q2, k2 = case.q.repeat(1, 2, 1), case.k.repeat(1, 2, 1)
        delta_kernels.chunk_gated_delta_rule(q2, k2, case.v[:, :1].repeat(1, 3, 1), case.g[:, :1].repeat(1, 3),
                                             case.beta[:, :1].repeat(1, 3), case.cu_seqlens)
    with pytest.raises(ValueError, match="state"):
        delta_kernels.fused_recurrent_gated_delta_rule_update(case.q[:2], case.k[:2], case.v[:2], case.g[:2],
                                                              case.beta[:2], case.state[:, :1])
