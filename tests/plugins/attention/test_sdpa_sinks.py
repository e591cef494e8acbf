"""Attention sinks in ``sdpa`` (GPT-OSS: ``exp(sinks[h])`` joins each row's softmax denominator):
against the definition written out in float64 here, and against transformers' own GPT-OSS
attention (``eager_attention_forward`` of ``modeling_gpt_oss``)."""

from __future__ import annotations

import pytest
import torch

from lmplug.interfaces.attention import ATTENTION_SINKS, LayerAttention
from lmplug.testing.attention_case import build_case
from lmplug.testing.batches import BATCH_SPECS, BatchSpec
from lmplug.testing.reference import visibility_mask


def sink_reference(case, sinks: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Per sequence and head: ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h))``, out = sum p_j v_j."""
    spec = case.spec
    group = spec.num_heads // spec.num_kv_heads
    out, start = [], 0
    for keys, values, qlen in zip(case.keys, case.values, spec.query_lens):
        q = case.q[start:start + qlen].double()
        k = keys.double()[:, torch.arange(spec.num_heads) // group]
        v = values.double()[:, torch.arange(spec.num_heads) // group]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = visibility_mask(qlen, keys.shape[0], window)
        weights = torch.exp(scores).masked_fill(~visible, 0.0)
        denom = weights.sum(-1, keepdim=True) + torch.exp(sinks.double()).view(-1, 1, 1)
        out.append(torch.einsum("hqk,khd->qhd", weights / denom, v))
        start += qlen
    return torch.cat(out)


def run_sdpa(spec: BatchSpec, layout: str, sinks: torch.Tensor, window: int | None = None, dtype=torch.float32):
    from lmplug_attention.sdpa import SdpaAttention

    case = build_case(spec, layout, dtype, "cpu")
    scale = spec.softmax_scale
    layers = (LayerAttention(scale, window, sinks=True),)
    backend = SdpaAttention(SdpaAttention.Options(), num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                            head_dim=spec.head_dim, scale=scale, layers=layers)
    with torch.inference_mode():
        out = backend.forward(0, case.q, case.k, case.v, case.view, case.ctx, sinks=sinks.to(dtype))
    return case, out


def test_sdpa_lists_the_sinks_feature():
    from lmplug_attention.sdpa import SdpaAttention

    assert ATTENTION_SINKS in SdpaAttention.capabilities.features


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["decode_small", "decode_gqa4", "prefill_gqa8", "prefill_cached_prefix",
                                  "mixed", "varlen_block8"])
def test_sinks_match_the_definition(name: str, layout: str):
    spec = BATCH_SPECS[name]
    sinks = torch.linspace(-2.0, 3.0, spec.num_heads)  # some sinks dominate, some hardly count
    case, out = run_sdpa(spec, layout, sinks)
    torch.testing.assert_close(out.double(), sink_reference(case, sinks, spec.softmax_scale, None),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sliding_window_prefill", "sliding_window_decode", "sliding_window_mixed"])
def test_sinks_with_a_sliding_window(name: str):
    spec = BATCH_SPECS[name]
    sinks = torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(3))
    case, out = run_sdpa(spec, "paged", sinks, window=spec.sliding_window)
    torch.testing.assert_close(out.double(), sink_reference(case, sinks, spec.softmax_scale, spec.sliding_window),
                               atol=2e-5, rtol=1e-5)


def test_sinks_change_the_output():
    """A large sink takes almost all the weight: the output shrinks towards zero (the test above
    would pass for a backend that ignores the sinks only if the reference did too)."""
    spec = BATCH_SPECS["mixed"]
    _, plain = run_sdpa(spec, "paged", torch.full((spec.num_heads,), -80.0))
    _, sunk = run_sdpa(spec, "paged", torch.full((spec.num_heads,), 30.0))
    assert plain.abs().max() > 0.1
    assert sunk.abs().max() < 1e-6


@pytest.mark.hf
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("name", ["mixed", "prefill_cached_prefix", "decode_gqa4"])
def test_sinks_match_transformers_gpt_oss_attention(name: str, window: int | None):
    """Each sequence of the step through transformers' GPT-OSS eager attention (its queries over
    the whole cached + new context, the additive causal or sliding mask) against ``sdpa``."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    spec = BATCH_SPECS[name]
    sinks = torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(5))
    case, out = run_sdpa(spec, "paged", sinks, window=window)

    class Module(torch.nn.Module):
        num_key_value_groups = spec.num_heads // spec.num_kv_heads

    module = Module().eval()
    module.sinks = sinks
    start = 0
    for keys, values, qlen in zip(case.keys, case.values, spec.query_lens):
        visible = visibility_mask(qlen, keys.shape[0], window)
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        expected, _ = eager_attention_forward(module, case.q[start:start + qlen].transpose(0, 1)[None],
                                              keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask,
                                              spec.softmax_scale)
        torch.testing.assert_close(out[start:start + qlen], expected[0], atol=1e-5, rtol=1e-5)
        start += qlen
