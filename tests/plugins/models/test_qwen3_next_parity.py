"""Parity with HF transformers for tiny random Qwen3-Next checkpoints (gated DeltaNet + gated attention).

transformers builds, randomises (norms, including the zero-centred ones and the DeltaNet's gated
norm, and biases) and saves each model; lmplug loads the folder and runs it through the engine:
the DeltaNet layers' conv1d and gated delta rule through the mixer backend (``torch`` on CPU),
each sequence's conv and recurrent state in a slot of the KV cache's state pool, the attention
layers' K/V in the KV cache. The state must carry across chunked-prefill chunks (budgets 1, 7
and 64 tokens), restart cleanly after preemption, and stay per sequence in a batch. The greedy
reference is a loop over HF's forward with its cache (``hf_greedy_loop``).
"""

from __future__ import annotations

import json

import pytest
import torch
from support.hf_models import build_hf_model, hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.moe_models import hf_greedy_loop
from support.state_models import (
    PROMPT_LEN,
    StateModelParity,
    TinyStateModel,
    hf_prompt_logprobs,
    prompt_logprobs,
)

from lmplug import LLM, SamplingParams
from lmplug.errors import ModelLoadError

pytestmark = pytest.mark.hf

_BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
         "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "num_experts_per_tok": 2}
LIN, FULL = "linear_attention", "full_attention"
SPECS = {
    # 2 key heads of 16 over 4 value heads of 8 (the interleaved qkvz layout in groups of 2), GQA
    # attention with half of each head rotated; MoE everywhere except layer 1 (mlp_only_layers)
    "moe": {"num_hidden_layers": 4, "layer_types": [LIN, FULL, LIN, FULL], "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 8, "num_experts": 4, "mlp_only_layers": [1],
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # attention first, two DeltaNet layers after it, one key head per value head, a quarter of
    # each head rotated, q/k/v/o biases, kernel 3; MoE on every second layer, routing weights raw
    "sparse_step": {"num_hidden_layers": 3, "layer_types": [FULL, LIN, LIN], "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 3,
                    "linear_num_value_heads": 3, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
                    "linear_conv_kernel_dim": 3, "num_experts": 4, "decoder_sparse_step": 2,
                    "norm_topk_prob": False, "attention_bias": True,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25}},
    # no experts at all (every layer the dense MLP), one DeltaNet layer between two attention ones
    "dense": {"num_hidden_layers": 3, "layer_types": [FULL, LIN, FULL], "num_attention_heads": 4,
              "num_key_value_heads": 4, "head_dim": 16, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 0,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
}


class TinyQwen3Next(TinyStateModel):
    def __init__(self, name: str, root) -> None:
        from transformers import AutoConfig

        cfg = AutoConfig.for_model("qwen3_next", **{**_BASE, **SPECS[name]})
        cfg._attn_implementation = "eager"
        super().__init__(build_hf_model(cfg), root / name)


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    return TinyQwen3Next(request.param, tmp_path_factory.mktemp("qwen3_next"))


def test_the_engine_keeps_kv_and_states_per_layer_kind(tiny):
    cfg = tiny.hf.config
    engine = tiny.llm().engine
    spec = engine.kv.spec
    assert spec.num_layers == cfg.layer_types.count(FULL)
    assert [s.layer for s in spec.states] == [i for i, t in enumerate(cfg.layer_types) if t == LIN]
    assert engine.resolved.backends["mixer"].name == "torch"  # auto on CPU, no mixer section
    conv, recurrent = spec.states[0].tensors
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
        + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    assert (conv.name, conv.shape) == ("conv", (conv_dim, cfg.linear_conv_kernel_dim - 1))
    assert recurrent.name == "recurrent" and recurrent.dtype == torch.float32
    assert recurrent.shape == (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    mlps = [type(layer.mlp).__name__ for layer in engine.parts.model.layers]
    hf_mlps = [type(layer.mlp).__name__.removeprefix("Qwen3Next") for layer in tiny.hf.model.layers]
    assert mlps == [{"SparseMoeBlock": "SparseMoeBlock", "MLP": "MLP"}[m] for m in hf_mlps]


@pytest.mark.slow  # the interpreted kernels; Mamba2's engine test and TestTritonMixer stay in make test
def test_triton_mixer_generates_the_same_tokens(tiny):
    """The Triton conv1d and gated-delta kernels (interpreted on CPU) inside the engine: HF's
    greedy tokens, through a prefill and decodes."""
    if tiny.path.name != "moe":
        pytest.skip("one model is enough for the interpreted kernels")
    prompt = prompt_ids(12, seed=4)
    llm = tiny.llm(mixer="triton", kvcache="paged")
    assert llm.engine.resolved.backends["mixer"].name == "triton"
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids \
        == hf_greedy_loop(tiny.hf, prompt, 6)


# -- checkpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return TinyQwen3Next("moe", tmp_path_factory.mktemp("qwen3_next_moe"))


def test_stacked_experts_and_mtp_weights_load(moe_model, tmp_path):
    """transformers 5's in-memory layout (stacked experts), plus a multi-token-prediction module
    in the file (``mtp.*``, the drafter's): the same logprobs."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "stacked"
    moe_model.hf.save_pretrained(path, save_original_format=False)
    tensors = load_file(str(path / "model.safetensors"))
    assert any(n.endswith(".experts.gate_up_proj") for n in tensors)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256)
    torch.testing.assert_close(prompt_logprobs(llm, prompt), hf_prompt_logprobs(moe_model.hf, prompt),
                               atol=1e-4, rtol=0)


def test_a_missing_deltanet_tensor_is_named(moe_model, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "missing"
    moe_model.hf.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.linear_attn.in_proj_ba.weight"], tensors["model.layers.0.linear_attn.A_log"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.0\.linear_attn\.A_log.*layers\.2\.linear_attn\.in_proj_ba"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)


def test_layer_types_of_the_wrong_length_are_refused(moe_model, tmp_path):
    path = tmp_path / "bad"
    moe_model.hf.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = cfg["layer_types"][:-1]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="layer_types"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)


class TestEngineParity(StateModelParity):
    """Logprobs, greedy tokens, chunked prefill, batching and preemption against transformers."""
