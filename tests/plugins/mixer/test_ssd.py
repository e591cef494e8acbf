"""Mamba2's SSD scan: the reference against transformers and float64, the kernels against the reference, a whole mixer.

Ground truths nobody here wrote: transformers' ``mamba2_chunk_scan`` and
``mamba2_selective_state_update`` (run one sequence at a time), the recurrence
itself in float64, and transformers' ``Mamba2Mixer`` (random weights), whose
prefill and cached decode the ops rebuild: in_proj split, conv + SiLU, SSD,
gated RMSNorm, out_proj, with the ``ref`` ops and with the Triton ones (on
``kernel_device``: the CPU under ``TRITON_INTERPRET=1`` or compiled on a GPU).
Both ops on a pool of state slots (``state_indices``, slots shuffled, more slots
than sequences) equal them on the gathered per-batch states, other slots left
bit-identical.
Tolerance fp32: atol = rtol = 2e-5 (outputs of magnitude ~10, sums over a
few dozen tokens); 16-bit inputs are compared after the same rounding of the
inputs, with the output's precision (the kernels widen 16-bit operands to
fp32, so bf16 runs under the interpreter too: it has no bf16 ``tl.dot``).
"""

from __future__ import annotations

import math

import pytest
import torch
from lmplug_mixer import conv1d_kernels, conv1d_ref, ssd_kernels, ssd_ref
from support.state_pools import others, pool_with
from transformers import DynamicCache, Mamba2Config
from transformers.models.mamba2 import modeling_mamba2 as hf

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 5e-3, "rtol": 5e-3},
       torch.bfloat16: {"atol": 4e-2, "rtol": 4e-2}}
LIMIT = (0.01, 0.3)  # a time_step_limit that bites: softplus(dt + dt_bias) spans both sides of it


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def inputs(lens: list[int], heads: int = 4, head_dim: int = 8, groups: int = 2, state: int = 16,
           seed: int = 0) -> dict:
    """Random SSD inputs; dt + dt_bias around -2 (as Mamba2's inverse-softplus init), initial states."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return {"x": torch.randn(T, heads, head_dim, generator=g), "dt": torch.randn(T, heads, generator=g),
            "A": -torch.rand(heads, generator=g) * 4 - 0.5, "B": torch.randn(T, groups, state, generator=g),
            "C": torch.randn(T, groups, state, generator=g), "D": torch.randn(heads, generator=g),
            "dt_bias": torch.randn(heads, generator=g) - 2,
            "initial_state": torch.randn(len(lens), heads, head_dim, state, generator=g)}


def recurrence64(inp: dict, lens: list[int], dt_limit=(0.0, math.inf), with_initial=True):
    """The SSM step by step in float64: S = exp(dt A) S + dt x B^T, y = S C + D x."""
    x, B, C = inp["x"].double(), inp["B"].double(), inp["C"].double()
    heads, groups = x.shape[1], B.shape[1]
    dt = torch.nn.functional.softplus(inp["dt"].double() + inp["dt_bias"].double()).clamp(*dt_limit)
    ys, finals, t = [], [], 0
    for i, n in enumerate(lens):
        S = inp["initial_state"][i].double() * with_initial  # [H, P, N]
        for _ in range(n):
            Bh = B[t].repeat_interleave(heads // groups, 0)  # [H, N]
            Ch = C[t].repeat_interleave(heads // groups, 0)
            decay = torch.exp(dt[t] * inp["A"].double())[:, None, None]
            S = decay * S + (dt[t, :, None] * x[t])[..., None] * Bh[:, None]
            ys.append(torch.einsum("hpn,hn->hp", S, Ch) + inp["D"].double()[:, None] * x[t])
            t += 1
        finals.append(S)
    return torch.stack(ys), torch.stack(finals)


def scan(ops, inp: dict, cu: torch.Tensor, chunk_size: int, **kw):
    return ops.ssd_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], cu,
                              inp["initial_state"], chunk_size, dt_bias=inp["dt_bias"], **kw)


@pytest.mark.parametrize("lens", [[13], [1, 8, 21], [5, 16, 3, 10]])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), LIMIT])
def test_reference_equals_transformers(lens, groups, dt_limit):
    """Lengths not multiples of the chunk (8), carried initial states, the time-step clamp."""
    inp = inputs(lens, groups=groups)
    y, final = scan(ssd_ref, inp, cu_of(lens), 8, dt_limit=dt_limit)
    cu = cu_of(lens).tolist()
    for i in range(len(lens)):
        s = slice(cu[i], cu[i + 1])
        expected_y, expected_state = hf.mamba2_chunk_scan(
            inp["x"][None, s], inp["dt"][None, s], inp["A"], inp["B"][None, s], inp["C"][None, s],
            chunk_size=8, D=inp["D"], dt_bias=inp["dt_bias"], initial_states=inp["initial_state"][i:i + 1],
            dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
        torch.testing.assert_close(y[s], expected_y[0], **TOL[torch.float32])
        torch.testing.assert_close(final[i], expected_state[0], **TOL[torch.float32])


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_reference_equals_float64_recurrence(chunk_size):
    lens = [3, 19, 9]
    inp = inputs(lens, seed=1)
    expected_y, expected_state = recurrence64(inp, lens, LIMIT)
    y, final = scan(ssd_ref, inp, cu_of(lens), chunk_size, dt_limit=LIMIT)
    torch.testing.assert_close(y.double(), expected_y, **TOL[torch.float32])
    torch.testing.assert_close(final.double(), expected_state, **TOL[torch.float32])
    # no initial state and no D: zeros and no skip
    inp["D"] = torch.zeros_like(inp["D"])
    expected_y, expected_state = recurrence64(inp, lens, with_initial=False)
    y, final = ssd_ref.ssd_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], None, cu_of(lens),
                                      None, chunk_size, dt_bias=inp["dt_bias"])
    torch.testing.assert_close(y.double(), expected_y, **TOL[torch.float32])
    torch.testing.assert_close(final.double(), expected_state, **TOL[torch.float32])


@pytest.mark.parametrize("pieces", [[[5, 11], [1, 2, 17]], [[8, 8, 3], [20]]])
def test_chunked_prefill_equals_one_pass(pieces):
    """Each sequence run in pieces (the state carried from one to the next) == one pass."""
    lens = [sum(p) for p in pieces]
    inp = inputs(lens, seed=2)
    y, final = scan(ssd_ref, inp, cu_of(lens), 8)
    cu = cu_of(lens).tolist()
    for i, parts in enumerate(pieces):
        state, start = inp["initial_state"][i:i + 1], cu[i]
        for n in parts:
            s = slice(start, start + n)
            part = {**{k: inp[k][s] for k in ("x", "dt", "B", "C")}, "initial_state": state,
                    **{k: inp[k] for k in ("A", "D", "dt_bias")}}
            out, state = scan(ssd_ref, part, cu_of([n]), 8)
            torch.testing.assert_close(out, y[s], **TOL[torch.float32])
            start += n
        torch.testing.assert_close(state[0], final[i], **TOL[torch.float32])


@pytest.mark.parametrize("groups", [1, 2])
def test_decode_steps_equal_prefill_and_transformers(groups):
    batch, steps = 3, 7
    inp = inputs([steps] * batch, groups=groups, seed=3)
    y, final = scan(ssd_ref, inp, cu_of([steps] * batch), 4, dt_limit=LIMIT)
    step = {k: inp[k].view(batch, steps, *inp[k].shape[1:]) for k in ("x", "dt", "B", "C")}
    ours, theirs = inp["initial_state"].clone(), inp["initial_state"].clone()
    heads, head_dim, state_size = ours.shape[1:]
    for t in range(steps):
        x, dt, B, C = (step[k][:, t] for k in ("x", "dt", "B", "C"))
        out = ssd_ref.ssd_state_update(ours, x, dt, inp["A"], B, C, inp["D"], inp["dt_bias"], dt_limit=LIMIT)
        torch.testing.assert_close(out, y.view(batch, steps, heads, head_dim)[:, t], **TOL[torch.float32])
        # transformers' decode takes no dt_limit: compare it without one, as Mamba2Mixer calls it
        plain = ssd_ref.ssd_state_update(theirs.clone(), x, dt, inp["A"], B, C, inp["D"], inp["dt_bias"])
        expected = hf.mamba2_selective_state_update(
            theirs, x, dt[..., None].expand(-1, -1, head_dim),
            inp["A"][:, None, None].expand(-1, head_dim, state_size), B, C,
            inp["D"][:, None].expand(-1, head_dim), z=None,
            dt_bias=inp["dt_bias"][:, None].expand(-1, head_dim), dt_softplus=True)
        torch.testing.assert_close(plain, expected, **TOL[torch.float32])
    torch.testing.assert_close(ours, final, **TOL[torch.float32])


def strided(inp: dict, device: str, dtype: torch.dtype) -> dict:
    """The inputs on ``device`` in ``dtype``, x / dt / B / C as column slices of one wide tensor (as
    Mamba2's split projection hands them over); states stay fp32."""
    T = inp["x"].shape[0]
    parts = [inp[k].reshape(T, -1) for k in ("x", "dt", "B", "C")]
    wide = torch.cat([torch.zeros(T, 3), *parts], dim=1).to(device, dtype)
    out, col = {}, 3
    for k, p in zip(("x", "dt", "B", "C"), parts):
        out[k] = wide[:, col:col + p.shape[1]].view(inp[k].shape)
        col += p.shape[1]
    out.update({k: inp[k].to(device) for k in ("A", "D", "dt_bias", "initial_state")})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens,heads,head_dim,groups,state,chunk_size", [
    ([1, 17, 30], 4, 8, 2, 16, 16),
    ([9, 0, 24], 2, 20, 1, 12, 8),  # an empty sequence; head_dim and state past a power of two
    ([40], 2, 72, 2, 8, 32),  # three head-dim tiles, the last one partial
    ([7, 26], 2, 16, 1, 40, 16),  # state lanes in tiles (the interpreter's 16 at a time), the last partial
])
def test_chunk_scan_kernel_equals_reference(lens, heads, head_dim, groups, state, chunk_size, dtype,
                                            kernel_device):
    inp = strided(inputs(lens, heads, head_dim, groups, state, seed=4), kernel_device, dtype)
    cu = cu_of(lens).to(kernel_device)
    expected = scan(ssd_ref, inp, cu, chunk_size, dt_limit=LIMIT)
    got = scan(ssd_kernels, inp, cu, chunk_size, dt_limit=LIMIT)
    torch.testing.assert_close(got[0], expected[0], **TOL[dtype])
    torch.testing.assert_close(got[1], expected[1], **TOL[dtype])


def test_chunk_scan_kernel_fresh_sequences_without_d(kernel_device):
    lens = [6, 21]
    inp = strided(inputs(lens, seed=5), kernel_device, torch.float32)
    cu = cu_of(lens).to(kernel_device, torch.int64)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], None, cu, None, 16)
    expected = ssd_ref.ssd_chunk_scan(*args, dt_bias=None, dt_softplus=False)
    got = ssd_kernels.ssd_chunk_scan(*args, dt_bias=None, dt_softplus=False)
    torch.testing.assert_close(got[0], expected[0], **TOL[torch.float32])
    torch.testing.assert_close(got[1], expected[1], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim,groups,state", [(4, 8, 2, 16), (2, 72, 1, 12)])
def test_state_update_kernel_equals_reference(heads, head_dim, groups, state, dtype, kernel_device):
    inp = strided(inputs([1] * 3, heads, head_dim, groups, state, seed=6), kernel_device, dtype)
    ours, theirs = inp["initial_state"].clone(), inp["initial_state"].clone()
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"])
    for _ in range(2):
        expected = ssd_ref.ssd_state_update(theirs, *args, dt_limit=LIMIT)
        got = ssd_kernels.ssd_state_update(ours, *args, dt_limit=LIMIT)
        torch.testing.assert_close(got, expected, **TOL[dtype])
        torch.testing.assert_close(ours, theirs, **TOL[torch.float32])


def test_bad_state_is_refused():
    inp = inputs([4])
    with pytest.raises(ValueError, match="state must be float32"):
        ssd_kernels.ssd_state_update(inp["initial_state"].half(), inp["x"][:1], inp["dt"][:1], inp["A"],
                                     inp["B"][:1], inp["C"][:1])


# -- a pool of state slots ------------------------------------------------------------------------------


def check_pool(ops, device: str, index_dtype: torch.dtype, tol: dict) -> None:
    """The scan, then two decode steps, on a pool == on the per-batch states; other slots untouched."""
    lens = [5, 0, 19]  # an empty sequence keeps its state
    inp = strided(inputs(lens, heads=2, head_dim=8, groups=1, state=16, seed=8), device, torch.float32)
    cu = cu_of(lens).to(device)
    y, final = scan(ops, inp, cu, 16, dt_limit=LIMIT)
    slots, pool = pool_with(inp["initial_state"], 8, index_dtype, seed=9)
    before = pool.clone()
    y_pool, returned = scan(ops, {**inp, "initial_state": pool}, cu, 16, dt_limit=LIMIT, state_indices=slots)
    assert returned is None
    torch.testing.assert_close(y_pool, y, **tol)
    torch.testing.assert_close(pool[slots.long()], final, **tol)
    state = pool[slots.long()]  # the per-batch states continue from the same values
    for seed in (10, 11):  # one new token of each sequence per step
        step = strided(inputs([1] * 3, heads=2, head_dim=8, groups=1, state=16, seed=seed), device, torch.float32)
        args = (step["x"], step["dt"], inp["A"], step["B"], step["C"], inp["D"], inp["dt_bias"])
        expected = ops.ssd_state_update(state, *args, dt_limit=LIMIT)
        got = ops.ssd_state_update(pool, *args, dt_limit=LIMIT, state_indices=slots)
        torch.testing.assert_close(got, expected, **tol)
        torch.testing.assert_close(pool[slots.long()], state, **tol)
    torch.testing.assert_close(others(pool, slots), others(before, slots), atol=0, rtol=0)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_reference_on_a_state_pool(index_dtype):
    check_pool(ssd_ref, "cpu", index_dtype, {"atol": 0, "rtol": 0})


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernels_on_a_state_pool(index_dtype, kernel_device):
    check_pool(ssd_kernels, kernel_device, index_dtype, TOL[torch.float32])


def test_state_indices_are_checked():
    inp = inputs([4, 2])
    for ops in (ssd_ref, ssd_kernels):
        with pytest.raises(ValueError, match="needs the state pool"):
            ops.ssd_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], None, cu_of([4, 2]), None, 8,
                               state_indices=torch.tensor([0, 1]))
        with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[B\] = \[2\]"):
            ops.ssd_state_update(inp["initial_state"], inp["x"][:2], inp["dt"][:2], inp["A"], inp["B"][:2],
                                 inp["C"][:2], state_indices=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="state must be float32"):
        ssd_kernels.ssd_state_update(torch.zeros(5, 4, 8, 16, dtype=torch.float16), inp["x"][:2], inp["dt"][:2],
                                     inp["A"], inp["B"][:2], inp["C"][:2], state_indices=torch.tensor([3, 1]))


# -- a whole Mamba2 mixer from the ops ----------------------------------------------------------------


def make_mixer(groups: int, device: str) -> tuple[hf.Mamba2Mixer, Mamba2Config]:
    config = Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=groups, expand=2,
                          conv_kernel=4, chunk_size=8, num_hidden_layers=1, vocab_size=16)
    torch.manual_seed(groups)
    mixer = hf.Mamba2Mixer(config, layer_idx=0)
    with torch.no_grad():  # beyond the default init, so that D, A and the norm weight matter
        mixer.D.normal_()
        mixer.A_log.uniform_(-1, 1.5)
        mixer.norm.weight.normal_(1, 0.5)
        mixer.conv1d.bias.normal_()
    return mixer.to(device).eval(), config


class MixerOps:
    """Mamba2Mixer's forward written with the ops under test (``conv`` and ``ssd``: ref or kernels)."""

    def __init__(self, mixer: hf.Mamba2Mixer, conv, ssd) -> None:
        self.m, self.conv, self.ssd = mixer, conv, ssd
        self.groups, self.state_size = mixer.n_groups, mixer.ssm_state_size
        self.heads, self.head_dim = mixer.num_heads, mixer.head_dim

    def _split(self, hidden: torch.Tensor):
        m = self.m
        proj = m.in_proj(hidden)
        return proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)  # gate, xBC, dt

    def _finish(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm (per group of intermediate channels, gate through SiLU first), out_proj."""
        m = self.m
        y = y.reshape(gate.shape).float() * torch.nn.functional.silu(gate.float())
        grouped = y.view(*y.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + m.norm.variance_epsilon)
        return m.out_proj(m.norm.weight * grouped.view_as(y).to(gate.dtype))

    def _xbc(self, xbc: torch.Tensor):
        m, n = self.m, self.groups * self.state_size
        x, B, C = xbc.split([m.intermediate_size, n, n], dim=-1)
        lead = xbc.shape[:-1]
        return (x.view(*lead, self.heads, self.head_dim), B.view(*lead, self.groups, self.state_size),
                C.view(*lead, self.groups, self.state_size))

    def prefill(self, hidden: torch.Tensor, cu: torch.Tensor, conv_state, ssm_state):
        """hidden [T, hidden] flattened sequences -> (out [T, hidden], conv_state, ssm_state)."""
        m = self.m
        gate, xbc, dt = self._split(hidden)
        xbc, conv_state = self.conv.causal_conv1d(xbc, m.conv1d.weight[:, 0], m.conv1d.bias, cu, conv_state,
                                                  "silu")
        x, B, C = self._xbc(xbc)
        y, ssm_state = self.ssd.ssd_chunk_scan(x, dt, -torch.exp(m.A_log.float()), B, C, m.D, cu, ssm_state,
                                               m.chunk_size, dt_bias=m.dt_bias, dt_limit=m.time_step_limit)
        return self._finish(y, gate), conv_state, ssm_state

    def decode(self, hidden: torch.Tensor, conv_state, ssm_state) -> torch.Tensor:
        """hidden [B, hidden], one token per sequence; both states updated in place."""
        m = self.m
        gate, xbc, dt = self._split(hidden)
        xbc = self.conv.causal_conv1d_update(xbc, conv_state, m.conv1d.weight[:, 0], m.conv1d.bias, "silu")
        x, B, C = self._xbc(xbc)
        y = self.ssd.ssd_state_update(ssm_state, x, dt, -torch.exp(m.A_log.float()), B, C, m.D, m.dt_bias,
                                      dt_limit=m.time_step_limit)
        return self._finish(y, gate)


@pytest.mark.parametrize("ops,groups", [
    ("ref", 1), ("ref", 2), ("kernels", 2),
    pytest.param("kernels", 1, marks=pytest.mark.slow),  # ~10 s interpreted; the kernel cases cover G = 1
])
@torch.no_grad()
def test_mixer_from_ops_equals_transformers(groups, ops, kernel_device):
    """Prompts of 13, 5 and 22 tokens prefilled flattened in two chunks (the states carried), then
    3 decode steps of the three together == the mixer over each prompt, then its cached decode."""
    device = "cpu" if ops == "ref" else kernel_device
    mixer, config = make_mixer(groups, device)
    mine = MixerOps(mixer, *((conv1d_ref, ssd_ref) if ops == "ref" else (conv1d_kernels, ssd_kernels)))
    firsts, seconds, steps = [9, 1, 12], [4, 4, 10], 3
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randn(a + b, 64, generator=g).to(device) for a, b in zip(firsts, seconds)]
    tokens = torch.randn(steps, len(prompts), 64, generator=g).to(device)

    expected, caches = [], []
    for prompt in prompts:
        cache = DynamicCache(config=config)
        expected.append(mixer(prompt[None], cache=cache)[0])
        caches.append(cache)

    conv_state = ssm_state = None
    outs = [[] for _ in prompts]
    for lens, starts in ((firsts, [0] * len(prompts)), (seconds, firsts)):
        chunk = torch.cat([p[s:s + n] for p, s, n in zip(prompts, starts, lens)])
        out, conv_state, ssm_state = mine.prefill(chunk, cu_of(lens).to(device), conv_state, ssm_state)
        for i, piece in enumerate(out.split(lens)):
            outs[i].append(piece)
    for i, exp in enumerate(expected):
        torch.testing.assert_close(torch.cat(outs[i]), exp, **TOL[torch.float32])
        torch.testing.assert_close(ssm_state[i], caches[i].get_recurrent_state(0)[0], **TOL[torch.float32])
        # transformers keeps K conv columns, the oldest never read; the columns are in_proj outputs,
        # which a matmul over a chunk and one over the whole prompt may round differently
        torch.testing.assert_close(conv_state[i], caches[i].get_conv_state(0)[0, :, 1:], **TOL[torch.float32])

    for t in range(steps):
        out = mine.decode(tokens[t], conv_state, ssm_state)
        for i, cache in enumerate(caches):
            theirs = mixer(tokens[t, i][None, None], cache=cache)[0, 0]
            torch.testing.assert_close(out[i], theirs, **TOL[torch.float32])
            torch.testing.assert_close(ssm_state[i], cache.get_recurrent_state(0)[0], **TOL[torch.float32])

