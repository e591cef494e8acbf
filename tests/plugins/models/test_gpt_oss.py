"""Native GPT-OSS through the architecture conformance kit (transformers' outputs at 1e-4 and 32
greedy tokens, batched = alone with chunked prefill, paged = contiguous, preemption, TP=2), tiny
random configs with 2 and 4 experts per token (expert biases and sinks randomised, a SwiGLU clamp
low enough to bite, YaRN with and without truncation); ngram speculative decoding and int8 KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmplug.testing.architecture import ArchitectureConformance, build_tiny, hf_greedy, prompt

pytestmark = [pytest.mark.hf]

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
BASE: dict[str, Any] = {
    "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 6, "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 256,
    "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "rope_parameters": YARN,
}
CONFIGS = {
    "gpt_oss-top2": BASE,
    # four experts a token, three layers (sliding, full, sliding), a clamp the activations reach,
    # YaRN truncated (transformers' default)
    "gpt_oss-top4-clamped": {**BASE, "num_experts_per_tok": 4, "num_hidden_layers": 3, "swiglu_limit": 0.3,
                             "swiglu_alpha": 1.2, "rope_parameters": {**YARN, "truncate": True}},
}


def build_gpt_oss(config: dict[str, Any], path: Path, seed: int = 0):
    """``build_tiny`` with the experts' biases randomised too (transformers initialises them to zero,
    which would hide a loader that drops them)."""
    model = build_tiny(config, path, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.mark.slow
class TestGptOssSdpa(ArchitectureConformance):
    backend = "gpt_oss"
    configs = CONFIGS

    @pytest.fixture(scope="class")
    @classmethod
    def tiny(cls, tmp_path_factory):
        root = tmp_path_factory.mktemp("gpt_oss")
        return {name: (root / name, build_gpt_oss(config, root / name)) for name, config in cls.configs.items()}

    def llm_options(self) -> dict[str, Any]:
        return {"model_impl": self.backend, "attention": {"backend": "sdpa"}}


@pytest.fixture(scope="module")
def tiny_top4(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_top4")
    return path, build_gpt_oss(CONFIGS["gpt_oss-top4-clamped"], path)


def test_gpt_oss_is_chosen_natively_and_needs_sinks(tiny_top4):
    from lmplug.engine.architecture import choose_architecture
    from lmplug.interfaces.attention import needed_features
    from lmplug.plugins import get_registry

    info, reason = choose_architecture(BASE, "auto", "config.json", get_registry())
    assert info.name == "gpt_oss", reason
    arch = info.cls(info.cls.Options())
    layers = arch.cache_layout(arch.parse_config(BASE, "config.json")).layers
    assert [spec.sliding_window for spec in layers] == [8, None]
    assert all(spec.sinks for spec in layers)
    assert "attention_sinks" in needed_features(layers)


@pytest.mark.slow
def test_ngram_speculative_decoding_gives_transformers_greedy_tokens(tiny_top4):
    from lmplug import LLM, SamplingParams

    path, hf = tiny_top4
    ids = prompt(8, 3, 96) * 3  # repeated: the ngram drafter finds matches to propose
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, model_impl="gpt_oss",
              attention={"backend": "sdpa"}, speculative={"method": "ngram", "num_tokens": 3})
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, ids, 24)


@pytest.mark.parametrize("dtype, tolerance", [("int8", 0.05), ("fp8_e4m3", 0.25)])  # fp8: 3 mantissa bits
def test_quantized_kv_stays_close_to_transformers(tiny_top4, dtype, tolerance):
    from lmplug import LLM, SamplingParams
    from lmplug.testing.architecture import hf_prompt_logprobs, our_prompt_logprobs

    path, hf = tiny_top4
    ids = prompt(24, 1, 96)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, model_impl="gpt_oss",
              attention={"backend": "sdpa"}, kvcache={"backend": "paged", "block_size": 4, "dtype": dtype})
    out = llm.generate([ids], SamplingParams(prompt_logprobs=0, temperature=0, max_tokens=4, ignore_eos=True))[0]
    diff = (our_prompt_logprobs(out, ids) - hf_prompt_logprobs(hf, ids)).abs().max()
    assert 0 < diff < tolerance, f"kv {dtype}: prompt logprobs differ from transformers by {diff}"
