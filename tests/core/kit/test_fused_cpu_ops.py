"""The fused float32 CPU ops (``lmplug.kit.fused_cpu``) against their PyTorch references,
and the Llama blocks with the fused path on against the same blocks with it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmplug.kit import fused_cpu
from lmplug.kit.layers import (
    RMSNorm,
    apply_rope,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from lmplug.kit.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: the fused ops cannot build")


@pytest.fixture
def lib():
    return fused_cpu.library()


@pytest.fixture
def fused_off():
    """The PyTorch path for the duration of a test."""
    fused_cpu.set_enabled(False)
    yield
    fused_cpu.set_enabled(True)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 7), (2, 3, 64), (1, 1)])
def test_rms_norm_matches_torch(lib, shape):
    x = torch.randn(shape, generator=gen()) * 3
    w = torch.randn(shape[-1], generator=gen(1))
    got = fused_cpu.rms_norm(lib, x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=2e-6, atol=1e-6)


def test_rms_norm_of_strided_head_views(lib):
    """Qwen3's q/k norms read [T, H, D] views of the fused qkv row."""
    qkv = torch.randn(4, (6 + 2 * 2) * 32, generator=gen())
    q, k, _ = qkv.view(4, 10, 32).split_with_sizes([6, 2, 2], dim=1)
    w = torch.randn(32, generator=gen(1))
    for view in (q, k):
        got = fused_cpu.rms_norm(lib, view, w, 1e-6)
        assert got.is_contiguous() and got.shape == view.shape
        torch.testing.assert_close(got, F.rms_norm(view, (32,), w, 1e-6), rtol=2e-6, atol=1e-6)


def test_add_rms_norm_sums_into_x_and_normalises(lib):
    x = torch.randn(3, 576, generator=gen())
    residual = torch.randn(3, 576, generator=gen(1))
    w = torch.randn(576, generator=gen(2))
    expected_sum = x + residual
    total, normed = fused_cpu.add_rms_norm(lib, x.clone(), residual, w, 1e-5)
    assert torch.equal(total, expected_sum)  # one float add per element, as torch's
    torch.testing.assert_close(normed, F.rms_norm(expected_sum, (576,), w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,n", [(1, 1536), (4, 100), (2, 3)])
def test_silu_mul_matches_torch(lib, rows, n):
    x = torch.randn(rows, 2 * n, generator=gen()) * 6  # exp's range: large and small gates
    x[0, :3] = torch.tensor([-120.0, 95.0, 0.0])  # past the clamp of the C exp, and zero
    torch.testing.assert_close(fused_cpu.silu_mul(lib, x), silu_and_mul_reference(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("rows", "n"), [(1, 1536), (3, 17), (2, 1)])
def test_gelu_tanh_mul_matches_torch(lib, rows, n):
    """GeGLU's tanh GELU (Gemma) against torch's ``gelu(approximate="tanh")``, over the range where
    its tanh saturates both ways."""
    x = torch.randn(rows, 2 * n, generator=gen()) * 4
    torch.testing.assert_close(fused_cpu.gelu_tanh_mul(lib, x), gelu_tanh_and_mul_reference(x), rtol=4e-6,
                               atol=2e-6)


def test_gelu_tanh_and_mul_takes_the_fused_path_on_float32_cpu(lib, monkeypatch):
    calls = []
    monkeypatch.setattr(fused_cpu, "gelu_tanh_mul", lambda lib, x: calls.append(x) or gelu_tanh_and_mul_reference(x))
    x = torch.randn(2, 8, generator=gen())
    gelu_tanh_and_mul(x)
    gelu_tanh_and_mul(x.double())
    assert len(calls) == 1


def test_silu_mul_of_a_strided_row_view(lib):
    wide = torch.randn(3, 300, generator=gen())
    x = wide[:, :200]  # [3, 200], row stride 300
    torch.testing.assert_close(fused_cpu.silu_mul(lib, x), silu_and_mul_reference(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_in_place_is_the_torch_rope_bit_for_bit(lib, scaling):
    rope = RotaryEmbedding(64, 256, 10000.0, scaling, torch.float32)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=gen())
    q, k, v = qkv.view(5, 15, 64).split_with_sizes([9, 3, 3], dim=1)
    positions = torch.tensor([0, 1, 77, 200, 255])
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    v_before = v.clone()
    fused_cpu.rope_(lib, q, positions, rope.cos, rope.sin)
    fused_cpu.rope_(lib, k, positions, rope.cos, rope.sin)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, v_before)  # the rows' other heads are untouched


def test_rope_of_q_and_k_in_one_call_is_the_torch_rope(lib):
    """k's heads right after q's in each row (a fused q/k/v projection): one call over both; any
    other layout: one call each. Either way the torch RoPE's bits, v untouched."""
    rope = RotaryEmbedding(64, 256, 10000.0, None, torch.float32)
    positions = torch.tensor([0, 5, 130])
    qkv = torch.randn(3, (9 + 2 * 3) * 64, generator=gen())
    adjacent = qkv.view(3, 15, 64).split_with_sizes([9, 3, 3], dim=1)
    apart = (torch.randn(3, 9, 64, generator=gen(1)), torch.randn(3, 3, 64, generator=gen(2)))
    swapped = (adjacent[1], adjacent[0])  # k's heads *before* q's: not one run
    for q, k, v in (adjacent, (*apart, None), (*swapped, None)):
        ref_q, ref_k = rope(positions, q.clone(), k.clone())
        v_before = None if v is None else v.clone()
        fused_cpu.rope_qk_(lib, q, k, positions, rope.cos, rope.sin)
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
        assert v is None or torch.equal(v, v_before)


def test_rope_refuses_a_position_outside_the_table(lib):
    rope = RotaryEmbedding(16, 8, 10000.0, None, torch.float32)
    q = torch.randn(2, 2, 16)
    with pytest.raises(IndexError, match=r"position 8 of token 1 is outside the precomputed table \[0, 8\)"):
        fused_cpu.rope_(lib, q, torch.tensor([3, 8]), rope.cos, rope.sin)
    with pytest.raises(ValueError, match="positions must be a contiguous int64"):
        fused_cpu.rope_(lib, q, torch.tensor([3, 4], dtype=torch.int32), rope.cos, rope.sin)


def test_bad_shapes_are_refused_with_the_argument_named(lib):
    with pytest.raises(ValueError, match="rms_norm: weight must be contiguous float32 \\(8,\\)"):
        fused_cpu.rms_norm(lib, torch.randn(2, 8), torch.randn(4), 1e-5)
    with pytest.raises(ValueError, match="add_rms_norm: x and residual"):
        fused_cpu.add_rms_norm(lib, torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="silu_mul: expected \\[T, 2n\\]"):
        fused_cpu.silu_mul(lib, torch.randn(2, 7))
    with pytest.raises(ValueError, match="rope: x must be \\[T, N, D\\] with dense heads"):
        fused_cpu.rope_(lib, torch.randn(2, 16, 3).transpose(1, 2), torch.tensor([0, 1]),
                        torch.randn(4, 16), torch.randn(4, 16))


def test_layer_helpers_take_the_fused_path_only_where_they_can(fused_off):
    """Off (or for another dtype / autograd): the reference; results agree either way."""
    norm = RMSNorm(64, 1e-5, torch.float32)
    norm.weight.data = torch.randn(64, generator=gen())
    x = torch.randn(3, 64, generator=gen(1))
    gate_up = torch.randn(3, 40, generator=gen(2))
    off = norm(x), silu_and_mul(gate_up)
    fused_cpu.set_enabled(True)
    assert fused_cpu.active(x) is not None
    assert fused_cpu.active(x.double()) is None and fused_cpu.active(x.requires_grad_()) is None
    x = x.detach()
    torch.testing.assert_close(norm(x), off[0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(silu_and_mul(gate_up), off[1], rtol=2e-6, atol=1e-6)
    half = x.bfloat16()
    assert torch.equal(RMSNorm(64, 1e-5, torch.bfloat16)(half), RMSNorm(64, 1e-5, torch.bfloat16).reference(half))


def test_apply_rope_keeps_a_subclass_forward():
    class Shifted(RotaryEmbedding):
        def forward(self, positions, q, k):
            return super().forward(positions + 1, q, k)

    rope = Shifted(16, 32, 10000.0, None, torch.float32)
    q, k = torch.randn(2, 2, 16, generator=gen()), torch.randn(2, 1, 16, generator=gen(1))
    positions = torch.tensor([3, 4])
    want = rope(positions, q.clone(), k.clone())
    got = apply_rope(rope, positions, q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _tiny_decoder_layer(qk_norm: bool):
    from lmplug.interfaces.model_config import ModelConfig
    from lmplug.interfaces.quant import Unquantized
    from lmplug.kit.decoder import DecoderLayer

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 1,
                               "vocab_size": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
                               "head_dim": 16}, qk_norm=qk_norm)
    return cfg, DecoderLayer, Unquantized()


class _EchoAttention:
    """An attention backend stand-in: returns q (so the block's RoPE and norms shape the output)."""

    def forward(self, layer, q, k, v, kv, ctx):
        return q.clone() + k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) + v.mean()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decoder_layer_fused_matches_the_torch_path(qk_norm):
    cfg, DecoderLayer, quant = _tiny_decoder_layer(qk_norm)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0, torch.float32, quant, _EchoAttention())
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.2
    rope = RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, None, torch.float32)
    x = torch.randn(5, 64, generator=gen(3))
    positions = torch.tensor([0, 3, 9, 10, 63])
    with torch.inference_mode():
        fused_cpu.set_enabled(False)
        try:
            want = layer(x.clone(), positions, rope, None, None)
        finally:
            fused_cpu.set_enabled(True)
        got = layer(x.clone(), positions, rope, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
