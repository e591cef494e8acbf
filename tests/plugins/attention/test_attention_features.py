"""Logit soft-capping and attention sinks in every kernel of ``paged`` and ``flash``: the Triton
decode (split-K or not), the paged and flash prefills (on ``kernel_device``: the interpreter on
the CPU), the PyTorch paths (``decode_ref``, ``paged_cpu``, ``paged_torch``) and the C decode
kernel (its AVX-512 and portable loops), each against the math written here in float64:

    s = q.k * scale;  s = cap * tanh(s / cap) (soft-cap);
    out = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sinks[h])) (sinks: no value)

over the keys each query sees (causal, inside its window). Unused cache slots hold NaN."""

from __future__ import annotations

import math

import pytest
import torch
from support.paged_cases import paged_batch

SCALE = 0.35  # large enough that a cap of 2 bites: scores of a few units
FEATURES = [(None, False), (2.0, False), (None, True), (2.0, True)]
FEATURE_IDS = ["plain", "softcap", "sinks", "softcap+sinks"]


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], scale: float,
                   window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [L, H, D] at positions ``q_pos`` over one sequence's k, v [S, Hkv, D]: float64, a loop of dots."""
    num_heads, _ = q.shape[1:]
    group = num_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, p in enumerate(q_pos):
        keys = [j for j in range(p + 1) if window is None or j > p - window]
        for h in range(num_heads):
            qh = q[i, h].double()
            s = torch.stack([qh @ k[j, h // group].double() for j in keys]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            top = s.max() if sinks is None else torch.maximum(s.max(), sinks[h].double())
            w = torch.exp(s - top)
            den = w.sum() + (0.0 if sinks is None else torch.exp(sinks[h].double() - top))
            out[i, h] = (w[:, None] * torch.stack([v[j, h // group].double() for j in keys])).sum(0) / den
    return out


def context(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """One sequence's first ``n`` rows of a paged cache, [n, Hkv, D]."""
    bs = cache.shape[1]
    slots = [int(table[p // bs]) * bs + p % bs for p in range(n)]
    return cache.reshape(-1, *cache.shape[2:])[slots]


def sinks_for(num_heads: int, on: bool) -> torch.Tensor | None:
    # some below and some above the scores, so either side of the running max is covered
    return torch.linspace(-3.0, 4.0, num_heads) if on else None


def decode_math(q, kc, vc, tables, lens, window, softcap, sinks):
    rows = [math_attention(q[i:i + 1], context(kc, tables[i], n), context(vc, tables[i], n), [n - 1], SCALE,
                           window, softcap, sinks) for i, n in enumerate(lens.tolist())]
    return torch.cat(rows)


DECODE_LENS = [1, 37, 150, 9]


def _decode_case(dtype, block_size=16, heads=(8, 2), head_dim=32, lens=DECODE_LENS, seed=0):
    return paged_batch(lens, *heads, head_dim, block_size, dtype, seed=seed, poison=True)


# -- the Triton kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap,sinks", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("partition", [0, 32])  # 32: split-K, the sinks in the first partition only
def test_triton_paged_decode(kernel_device, softcap, sinks, window, partition):
    from lmplug_attention.paged.kernels import paged_decode_attention

    q, kc, vc, tables, lens = _decode_case(torch.float32)
    sink = sinks_for(q.shape[1], sinks)
    want = decode_math(q, kc, vc, tables, lens, window, softcap, sink)
    dev = [t.to(kernel_device) for t in (q, kc, vc, tables, lens)]
    got = paged_decode_attention(*dev, SCALE, sliding_window=window, partition_size=partition, softcap=softcap,
                                 sinks=None if sink is None else sink.to(kernel_device))
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap,sinks", FEATURES[1:], ids=FEATURE_IDS[1:])
def test_triton_flash_decode_fp16_split(kernel_device, softcap, sinks):
    from lmplug_attention.flash.decode_kernels import flash_decode_with_kvcache

    q, kc, vc, tables, lens = _decode_case(torch.float16, heads=(4, 4), seed=3)
    sink = sinks_for(q.shape[1], sinks)
    want = decode_math(q, kc, vc, tables, lens, None, softcap, sink)
    dev = [t.to(kernel_device) for t in (q, kc, vc, tables, lens)]
    got = flash_decode_with_kvcache(*dev, SCALE, num_splits=3, softcap=softcap,
                                    sinks=None if sink is None else sink.to(kernel_device))
    torch.testing.assert_close(got.cpu().double(), want, atol=3e-3, rtol=3e-3)


PREFILL = [(9, 9), (40, 17), (3, 1)]  # (seq_len, query_len): a fresh prompt, a chunk over a prefix, a decode


def _prefill_case(dtype, block_size=16, heads=(8, 2), head_dim=32, seed=1):
    lens = [s for s, _ in PREFILL]
    _, kc, vc, tables, seq_lens = paged_batch(lens, *heads, head_dim, block_size, dtype, seed=seed,
                                              poison=True)
    g = torch.Generator().manual_seed(seed + 10)
    q = torch.randn(sum(n for _, n in PREFILL), heads[0], head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor([n for _, n in PREFILL]).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, tables, seq_lens, cu


def prefill_math(q, kc, vc, tables, seq_lens, cu, window, softcap, sinks):
    out = []
    for i, (n, m) in enumerate(PREFILL):
        qi = q[int(cu[i]):int(cu[i + 1])]
        out.append(math_attention(qi, context(kc, tables[i], n), context(vc, tables[i], n),
                                  list(range(n - m, n)), SCALE, window, softcap, sinks))
    return torch.cat(out)


@pytest.mark.parametrize("softcap,sinks", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("impl", ["paged", "flash"])
def test_triton_prefill_over_the_cache(kernel_device, softcap, sinks, window, impl):
    from lmplug_attention.flash.prefill_kernels import flash_prefill_with_kvcache
    from lmplug_attention.paged.prefill_kernels import paged_prefill_attention

    q, kc, vc, tables, seq_lens, cu = _prefill_case(torch.float32)
    sink = sinks_for(q.shape[1], sinks)
    want = prefill_math(q, kc, vc, tables, seq_lens, cu, window, softcap, sink)
    dev = [t.to(kernel_device) for t in (q, kc, vc, tables, cu, seq_lens)]
    fn = paged_prefill_attention if impl == "paged" else flash_prefill_with_kvcache
    got = fn(*dev, SCALE, sliding_window=window, softcap=softcap,
             sinks=None if sink is None else sink.to(kernel_device))
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap,sinks", FEATURES[1:], ids=FEATURE_IDS[1:])
def test_triton_flash_varlen(kernel_device, softcap, sinks):
    """A fresh prompt's prefill from the step's packed K/V, small tiles so both masked and whole tiles run."""
    from lmplug_attention.flash.prefill_kernels import flash_varlen_attention

    g = torch.Generator().manual_seed(4)
    lens = [40, 7]
    q = torch.randn(sum(lens), 4, 32, generator=g)
    k, v = torch.randn(sum(lens), 2, 32, generator=g), torch.randn(sum(lens), 2, 32, generator=g)
    sink = sinks_for(4, sinks)
    want = torch.cat([math_attention(q[a:a + n], k[a:a + n], v[a:a + n], list(range(n)), SCALE, 12, softcap, sink)
                      for a, n in ((0, 40), (40, 7))])
    cu = torch.tensor([0, 40, 47], dtype=torch.int32)
    dev = [t.to(kernel_device) for t in (q, k, v, cu)]
    got = flash_varlen_attention(*dev, SCALE, sliding_window=12, block_m=16, block_n=16, softcap=softcap,
                                 sinks=None if sink is None else sink.to(kernel_device))
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5)


def test_triton_feature_arguments_are_checked():
    from lmplug_attention.attn_ops import feature_args

    with pytest.raises(ValueError, match="softcap must be None or a number > 0"):
        feature_args(0.0, None, 4, torch.device("cpu"), "x")
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[num_heads=4\]"):
        feature_args(None, torch.zeros(3), 4, torch.device("cpu"), "x")
    cap, sinks, capped, sunk = feature_args(30.0, torch.zeros(4, dtype=torch.bfloat16), 4, torch.device("cpu"), "x")
    assert math.isclose(cap, 30.0 / math.log(2)) and sinks.dtype == torch.float32 and capped and sunk


# -- the PyTorch paths and the C decode kernel --------------------------------------------------------


@pytest.mark.parametrize("softcap,sinks", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("window", [None, 20])
def test_torch_decode_paths(softcap, sinks, window):
    """``decode_ref`` (the quantized-KV decode) and ``paged_cpu`` (the gather + matmul decode)."""
    from lmplug_attention.decode_ref import decode_attention
    from lmplug_attention.paged import cpu as paged_cpu

    q, kc, vc, tables, lens = _decode_case(torch.float32)
    sink = sinks_for(q.shape[1], sinks)
    want = decode_math(q, kc, vc, tables, lens, window, softcap, sink)
    got = decode_attention(q, kc, vc, tables, lens, SCALE, sliding_window=window, softcap=softcap, sinks=sink)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    index = paged_cpu.decode_index(tables, lens, kc.shape[1], kc.shape[2], int(lens.max()), window)
    got = paged_cpu.paged_decode_attention_cpu(q, kc, vc, index, SCALE, softcap=softcap, sinks=sink)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap,sinks", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("window", [None, 6])
def test_torch_prefill_path(softcap, sinks, window):
    from lmplug_attention.paged.torch_path import paged_prefill_attention

    q, kc, vc, tables, seq_lens, cu = _prefill_case(torch.float32)
    sink = sinks_for(q.shape[1], sinks)
    want = prefill_math(q, kc, vc, tables, seq_lens, cu, window, softcap, sink)
    got = paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, SCALE, sliding_window=window, softcap=softcap,
                                  sinks=sink)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap,sinks", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("head_dim", [64, 40])  # 64: the AVX-512 loops where the CPU has them; 40: the portable ones
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_kernel(native, softcap, sinks, head_dim, window):
    q, kc, vc, tables, lens = _decode_case(torch.float32, block_size=4, heads=(9, 3), head_dim=head_dim)
    sink = sinks_for(q.shape[1], sinks)
    want = decode_math(q, kc, vc, tables, lens, window, softcap, sink)
    got = native.paged_decode_attention(q, kc, vc, tables, lens, SCALE, sliding_window=window, softcap=softcap,
                                        sinks=sink)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap,sinks", FEATURES[1:], ids=FEATURE_IDS[1:])
@pytest.mark.parametrize("head_dim", [64, 40])  # 64: the bf16 "pairs" AVX-512 layout
def test_native_decode_kernel_bf16(native, softcap, sinks, head_dim):
    q, kc, vc, tables, lens = _decode_case(torch.bfloat16, heads=(4, 2), head_dim=head_dim, seed=5)
    sink = sinks_for(q.shape[1], sinks)
    want = decode_math(q, kc, vc, tables, lens, None, softcap, sink)
    got = native.paged_decode_attention(q, kc, vc, tables, lens, SCALE, softcap=softcap, sinks=sink)
    # float32 math, one bf16 rounding of the output
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=2.0 ** -8)


def test_native_sink_far_above_every_score_gives_zeros_not_nan(native):
    """A sink 200 above the scores: the denominator is its exp (not an overflow), the output ~0."""
    q, kc, vc, tables, lens = _decode_case(torch.float32, heads=(2, 2))
    got = native.paged_decode_attention(q, kc, vc, tables, lens, SCALE, sinks=torch.tensor([200.0, -200.0]))
    want = decode_math(q, kc, vc, tables, lens, None, None, torch.tensor([200.0, -200.0]))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


# -- the backends: layers with and without each feature, in one model ------------------------------

# Gemma 2 (window + soft-cap), GPT-OSS (sinks, windowed or not), a plain layer: each its own scale
LAYERS = None  # built lazily: the interface import stays out of collection


def _model_layers():
    from lmplug.interfaces.attention import LayerAttention

    return (LayerAttention(0.3, 7, 2.0), LayerAttention(0.2, None, None, sinks=True),
            LayerAttention(0.25, 7, None, sinks=True), LayerAttention(0.35), LayerAttention(0.3, None, 1.5))


BACKENDS = [("paged", {"kernels": "torch"}), ("paged", {"kernels": "torch", "cpu_kernel": "torch"}),
            ("paged", {"kernels": "torch", "cpu_rows": "short"}), ("paged", {"kernels": "triton"}),
            ("flash", {}), ("sdpa", {})]
BACKEND_IDS = ["paged-native", "paged-torch", "paged-short-rows", "paged-triton", "flash", "sdpa"]


@pytest.mark.parametrize("name,options", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_backend_layers_mixed_in_one_model(name, options, layout):
    """One step (decodes, a fresh prompt, a chunk over a cached prefix) through every layer of a
    model whose layers differ in window, scale, soft-cap and sinks: each layer's output is the math
    with that layer's own features. sdpa (no sinks here) is checked on the layers without sinks."""
    from lmplug.interfaces.attention import ATTENTION_SINKS
    from lmplug.plugins import get_registry
    from lmplug.testing.attention_case import build_case
    from lmplug.testing.batches import BatchSpec

    cls = get_registry().backends("attention")[name].cls
    if name == "flash" or options.get("kernels") == "triton":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            pytest.skip("the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
    if cls.capabilities.kv_layouts.isdisjoint({layout}):
        pytest.skip(f"{name} does not read the {layout} layout")
    layers = _model_layers()
    spec = BatchSpec("mixed-layers", (1, 1, 12, 5), (30, 3, 0, 20), 8, 2, 32, block_size=4)
    case = build_case(spec, layout, torch.float32, "cpu")
    opts = cls.Options(**options)
    has_sinks = ATTENTION_SINKS in cls.features_for(opts, "cpu")
    impl = cls(opts, num_heads=8, num_kv_heads=2, head_dim=32, scale=layers[0].scale,
               sliding_window=layers[0].sliding_window, layers=layers)
    checked = 0
    for layer, la in enumerate(layers):
        if la.sinks and not has_sinks:
            continue
        sink = sinks_for(8, True) * (layer + 1) / 2 if la.sinks else None
        with torch.inference_mode():
            got = (impl.forward(layer, case.q, case.k, case.v, case.view, case.ctx, sinks=sink) if la.sinks else
                   impl.forward(layer, case.q, case.k, case.v, case.view, case.ctx))
        want, start = [], 0
        for i, (qlen, seq_len) in enumerate(zip(spec.query_lens, spec.seq_lens)):
            want.append(math_attention(case.q[start:start + qlen], case.keys[i], case.values[i],
                                       list(range(seq_len - qlen, seq_len)), la.scale, la.sliding_window,
                                       la.softcap, sink))
            start += qlen
        torch.testing.assert_close(got.double(), torch.cat(want), atol=3e-5, rtol=3e-5,
                                   msg=lambda m, layer=layer, la=la: f"layer {layer} ({la}): {m}")
        checked += 1
    assert checked == (3 if name == "sdpa" and not has_sinks else len(layers))
