"""The fused MoE kernels as built for real GPUs: the launch table per architecture and rows per
expert, the table's tiles run (interpreted on CPU) against a float64 loop, and experts too large
for 32-bit in-expert offsets refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lmplug_moe.fused_kernels import fused_experts, moe_config, pick_block_m
from lmplug_moe.routing import select_experts
from support.hf_models import one_torch_thread  # noqa: F401

from lmplug import RoutingConfig
from lmplug.kit.devices import target_capability

SM80, SM90 = (8, 0), (9, 0)


def case(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    ids, weights = select_experts(torch.randn(num_tokens, num_experts, generator=g), RoutingConfig(top_k))
    return x, ids, weights, w_gate_up, w_down


def dense_loop(x, ids, weights, w_gate_up, w_down) -> torch.Tensor:
    """float64, one (token, slot) at a time: the SwiGLU expert as published."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w_down.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w_gate_up[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w_down[e].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def test_table_per_architecture_and_rows_per_expert():
    decode = {cap: moe_config(cap, 8, 64, 4096, 1408) for cap in (SM80, SM90)}  # 8 pairs, 64 experts
    prefill = {cap: moe_config(cap, 65536, 64, 4096, 1408) for cap in (SM80, SM90)}  # 1024 per expert
    assert decode[SM80].block_m == decode[SM90].block_m == 16
    assert decode[SM80] != decode[SM90]  # Hopper: wider K steps at decode
    assert prefill[SM80].block_m == 64 and prefill[SM90].block_m == 128 and prefill[SM90].num_warps == 8
    # the gate/up kernel keeps two accumulators: its N tile stays narrower than the down kernel's
    assert prefill[SM90].block_n_gate_up < prefill[SM90].block_n_down
    # float32 experts (an FMA dot) take half the K step
    assert moe_config(SM90, 65536, 64, 4096, 1408, fp32=True).block_k == prefill[SM90].block_k // 2
    # the backend's block_m option wins; tiles never exceed the (power-of-two padded) problem
    assert moe_config(SM90, 65536, 64, 4096, 1408, block_m=32).block_m == 32
    small = moe_config(SM90, 8, 4, 24, 40)
    assert small.block_k == 32 and small.block_n_down == 32 and small.block_n_gate_up == 64
    # no GPU: the interpreter keeps today's small tiles (blocks of at most 64 rows)
    assert pick_block_m(65536, 64, None) == 64 and pick_block_m(8, 64, None) == 16


@pytest.mark.parametrize("target", [SM80, SM90], ids=["sm80", "sm90"])
@pytest.mark.parametrize("num_tokens", [3, 40])
def test_table_tiles_match_the_loop(target, num_tokens):
    """The sm_80 / sm_90 tile shapes (partial in N and K here) compute the published experts."""
    x, ids, weights, w_gate_up, w_down = case(num_tokens, 4, 48, 40, seed=num_tokens)
    with target_capability(target):
        out = fused_experts(x, ids, weights, w_gate_up, w_down)
    torch.testing.assert_close(out.double(), dense_loop(x, ids, weights, w_gate_up, w_down), atol=1e-4, rtol=1e-4)


def test_experts_past_32_bit_offsets_are_refused():
    meta = {"device": "meta"}
    x = torch.empty(2, 65536, **meta)
    ids = torch.zeros(2, 1, dtype=torch.long, **meta)
    weights = torch.empty(2, 1, **meta)
    w_gate_up = torch.empty(2, 2 * 32768, 65536, **meta)  # 2^32 elements in one expert
    w_down = torch.empty(2, 65536, 32768, **meta)
    with pytest.raises(ValueError, match=r"one expert of w_gate_up \(2, 65536, 65536\) spans 2\^31"):
        fused_experts(x, ids, weights, w_gate_up, w_down)
