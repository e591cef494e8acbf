"""MoE routing and experts: routing against per-token loops and transformers' routers, the
reference experts and the fused Triton kernels (on ``kernel_device``: interpreted on the CPU, or
compiled on a CUDA GPU) against float64 loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lmplug_moe.fused_kernels import fused_experts, moe_align_block_size
from lmplug_moe.reference import ReferenceMoE, reference_experts
from lmplug_moe.routing import select_experts
from support.devices import bf16_param
from support.hf_models import one_torch_thread  # noqa: F401

from lmplug import BackendOptions, RoutingConfig

V3 = RoutingConfig(top_k=4, renormalize=True, scoring="sigmoid", n_group=4, topk_group=2,
                   group_scoring="top2_sum", routed_scaling_factor=2.5)
V2_GROUPED = RoutingConfig(top_k=3, renormalize=False, n_group=4, topk_group=2, routed_scaling_factor=16.0)
RULES = {
    "mixtral": RoutingConfig(top_k=2),
    "qwen_raw": RoutingConfig(top_k=2, renormalize=False),
    "v2_grouped": V2_GROUPED,
    "v3": V3,
    "sigmoid_flat": RoutingConfig(top_k=3, scoring="sigmoid"),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- routing ------------------------------------------------------------------------------------------


def loop_route(logits: torch.Tensor, r: RoutingConfig, bias: torch.Tensor | None = None):
    """The published rule, one token at a time in float64, ties to the lower id."""
    ids_out, w_out = [], []
    for row in logits.double():
        scores = torch.softmax(row, 0) if r.scoring == "softmax" else torch.sigmoid(row)
        choice = (scores + bias.double() if bias is not None else scores).tolist()
        size = len(choice) // r.n_group
        groups = [sorted(choice[g * size:(g + 1) * size], reverse=True) for g in range(r.n_group)]
        group_score = [sum(g[:2]) if r.group_scoring == "top2_sum" else g[0] for g in groups]
        kept = sorted(range(r.n_group), key=lambda g: (-group_score[g], g))[:r.topk_group]
        allowed = [e for e in range(len(choice)) if e // size in kept]
        ids = sorted(allowed, key=lambda e: (-choice[e], e))[:r.top_k]
        w = torch.stack([scores[e] for e in ids])
        if r.renormalize:
            w = w / w.sum()
        ids_out.append(ids)
        w_out.append(w * r.routed_scaling_factor)
    return torch.tensor(ids_out), torch.stack(w_out)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_routing_matches_a_per_token_loop(rule, num_tokens):
    r = RULES[rule]
    logits = torch.randn(num_tokens, 16, generator=gen(num_tokens))
    bias = 0.1 * torch.randn(16, generator=gen(1)) if r.scoring == "sigmoid" else None
    ids, weights = select_experts(logits, r, bias)
    ref_ids, ref_w = loop_route(logits, r, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, atol=1e-6, rtol=1e-6)


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0], [2.0] * 6])
    ids, weights = select_experts(logits, RoutingConfig(top_k=2, renormalize=False))
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(weights[:, 0], weights[:, 1])
    # groups tie too: groups {0,1} and {2,3} score alike, the lower one is kept
    grouped = RoutingConfig(top_k=2, n_group=3, topk_group=1)
    ids, _ = select_experts(torch.tensor([[0.0, 5.0, 5.0, 0.0, 1.0, 1.0]]), grouped)
    assert ids.tolist() == [[1, 0]]


def test_int_top_k_is_short_for_softmax_routing():
    logits = torch.randn(9, 8, generator=gen(3))
    backend = ReferenceMoE(BackendOptions())
    for renorm in (True, False):
        short = backend.route(logits, 2, renorm)
        full = backend.route(logits, RoutingConfig(top_k=2, renormalize=renorm))
        assert torch.equal(short[0], full[0]) and torch.equal(short[1], full[1])


def test_routing_rejects_what_it_cannot_route():
    with pytest.raises(ValueError, match="topk_group"):
        RoutingConfig(top_k=2, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="scoring"):
        RoutingConfig(top_k=2, scoring="relu")
    with pytest.raises(ValueError, match="n_group=3"):
        select_experts(torch.randn(2, 8), RoutingConfig(top_k=2, n_group=3))
    with pytest.raises(ValueError, match="exceeds"):
        select_experts(torch.randn(2, 8), RoutingConfig(top_k=3, n_group=4, topk_group=1))
    with pytest.raises(ValueError, match="correction_bias"):
        select_experts(torch.randn(2, 8), RoutingConfig(top_k=2), torch.zeros(7))


def _hf_router(kind: str, num_experts: int = 16, top_k: int = 4):
    transformers = pytest.importorskip("transformers")
    common = {"hidden_size": 32, "num_experts_per_tok": top_k}
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as cls
        cfg = transformers.MixtralConfig(num_local_experts=num_experts, **common)
        rule = RoutingConfig(top_k)
    elif kind in ("qwen2_moe", "qwen3_moe"):
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
        cls = Qwen2MoeTopKRouter if kind == "qwen2_moe" else Qwen3MoeTopKRouter
        renorm = kind == "qwen3_moe"
        config_cls = transformers.Qwen2MoeConfig if kind == "qwen2_moe" else transformers.Qwen3MoeConfig
        cfg = config_cls(num_experts=num_experts, norm_topk_prob=renorm, **common)
        rule = RoutingConfig(top_k, renormalize=renorm)
    elif kind == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as cls
        cfg = transformers.DeepseekV3Config(n_routed_experts=num_experts, n_group=4, topk_group=2,
                                            norm_topk_prob=True, routed_scaling_factor=2.5, **common)
        rule = V3
    else:  # deepseek_v2 group_limited_greedy
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as cls
        cfg = transformers.DeepseekV2Config(n_routed_experts=num_experts, n_group=4, topk_group=2,
                                            topk_method="group_limited_greedy", routed_scaling_factor=16.0,
                                            **common)
        rule = RoutingConfig(top_k, renormalize=False, n_group=4, topk_group=2, routed_scaling_factor=16.0)
    return cls(cfg), rule


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_routing_matches_transformers_routers(kind):
    router, rule = _hf_router(kind)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen(5)))
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.05 * torch.randn(bias.shape, generator=gen(6)))
        x = torch.randn(23, 32, generator=gen(7))
        _, hf_w, hf_ids = router(x)
        ids, weights = select_experts(F.linear(x, router.weight), rule, bias)
    order, hf_order = ids.argsort(1), hf_ids.argsort(1)  # the k slots' order is free
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_w.float().gather(1, hf_order), atol=1e-6, rtol=1e-5)


# -- experts ------------------------------------------------------------------------------------------


def dense_loop(x, ids, weights, w_gate_up, w_down) -> torch.Tensor:
    """Each token, each of its experts, in float64."""
    x, w_gate_up, w_down = x.double(), w_gate_up.double(), w_down.double()
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double().tolist()):
            gate_up = w_gate_up[e] @ x[t]
            out[t] += w * (w_down[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def make_case(num_tokens, num_experts, hidden, inter, dtype, routing="random", top_k=2, seed=0):
    g = gen(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if routing == "unused_experts":  # only experts 0..top_k get tokens
        logits[:, top_k + 1:] -= 100
    elif routing == "one_expert":  # every token's first choice is expert 3
        logits[:, 3] += 100
    elif routing == "ties":  # all logits equal: every token picks experts 0..k-1 with equal weights
        logits.zero_()
    ids, weights = select_experts(logits, RoutingConfig(top_k))
    return x, ids, weights, w_gate_up, w_down


TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
ROUTINGS = ["random", "unused_experts", "one_expert", "ties"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_reference_experts_match_dense_loop(dtype, routing):
    case = make_case(21, 8, 32, 24, dtype, routing)
    out = reference_experts(*case)
    assert out.dtype == dtype and out.shape == (21, 32)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), dense_loop(*case), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", [(1, 8, 2, 64, 48), (33, 8, 2, 40, 24), (19, 6, 3, 32, 80)],
                         ids=["decode", "odd-hidden", "top3"])
def test_fused_experts_match_reference(shape, routing, dtype, kernel_device):
    num_tokens, num_experts, top_k, hidden, inter = shape
    case = make_case(num_tokens, num_experts, hidden, inter, dtype, routing, top_k, seed=num_tokens)
    out = fused_experts(*[t.to(kernel_device) for t in case])
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), dense_loop(*case), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_block_sizes_and_strided_input(block_m, kernel_device):
    x, ids, weights, w_gate_up, w_down = make_case(40, 8, 32, 32, torch.float32)
    wide = torch.randn(40, 64)
    wide[:, ::2] = x  # x as a strided view: [40, 32] with stride (64, 2)
    on = [t.to(kernel_device) for t in (wide, ids, weights, w_gate_up, w_down)]
    out = fused_experts(on[0][:, ::2], *on[1:], block_m=block_m)
    torch.testing.assert_close(out.double().cpu(), dense_loop(x, ids, weights, w_gate_up, w_down),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [bf16_param()])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter",
                         [(64, 8, 2, 64, 128), (300, 16, 4, 256, 192)], ids=["small", "prefill"])
def test_fused_experts_bf16(dtype, num_tokens, num_experts, top_k, hidden, inter, kernel_device):
    """Compiled only (bf16 ``tl.dot`` is wrong under the interpreter): ``bf16_param`` skips it there."""
    case = make_case(num_tokens, num_experts, hidden, inter, dtype, top_k=top_k)
    out = fused_experts(*[t.to(kernel_device) for t in case])
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), dense_loop(*case), atol=3e-2, rtol=3e-2)


def test_fused_no_tokens(kernel_device):
    x, ids, weights, w_gate_up, w_down = (t.to(kernel_device) for t in make_case(3, 4, 16, 16, torch.float32))
    out = fused_experts(x[:0], ids[:0], weights[:0], w_gate_up, w_down)
    assert out.shape == (0, 16)


def test_align_block_size_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1], [3, 2]])  # expert 2 gets 5 pairs, 4 experts
    sorted_pairs, block_experts, num_padded = moe_align_block_size(ids, num_experts=6, block_m=4)
    used = int(num_padded)
    assert used == 4 * (1 + 1 + 2 + 1)  # experts 0, 1, 2 (5 pairs: two blocks), 3; 4 and 5 own none
    blocks = sorted_pairs[:used].view(-1, 4)
    assert block_experts[:used // 4].tolist() == [0, 1, 2, 2, 3]
    assert (block_experts[used // 4:] == 6).all()  # past the end
    flat = ids.reshape(-1)
    for block, expert in zip(blocks, block_experts.tolist()):
        real = block[block < flat.numel()]
        assert (flat[real.long()] == expert).all()
    real = sorted_pairs[sorted_pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every pair exactly once


def test_fused_checks_its_arguments():
    x, ids, weights, w_gate_up, w_down = make_case(4, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="do not agree"):
        fused_experts(x, ids, weights, w_gate_up[:, :, :8], w_down)
    with pytest.raises(ValueError, match="share one of"):
        fused_experts(x.half(), ids, weights, w_gate_up, w_down)
    with pytest.raises(ValueError, match="integer"):
        fused_experts(x, ids.float(), weights, w_gate_up, w_down)
    with pytest.raises(ValueError, match="block_m"):
        fused_experts(x, ids, weights, w_gate_up, w_down, block_m=24)
