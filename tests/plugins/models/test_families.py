"""Native Gemma 2/3, SmolLM3, OLMo 2, Granite and Phi-3 through the architecture conformance kit
(transformers' own outputs at 1e-4 and 32 greedy tokens, batched = alone with chunked prefill,
preemption, TP=2 where declared), two or more tiny random configs per family, with and without
the family's options; each under ``sdpa`` and ``paged`` attention."""

from __future__ import annotations

from typing import Any

import pytest

from lmplug.testing.architecture import ArchitectureConformance

pytestmark = [pytest.mark.hf, pytest.mark.slow]

BASE: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
GEMMA2 = {**BASE, "model_type": "gemma2", "sliding_window": 8, "query_pre_attn_scalar": 24,
          "attn_logit_softcapping": None, "final_logit_softcapping": None}
GEMMA3 = {**BASE, "model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": 16,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
PHI3 = {**BASE, "model_type": "phi3", "num_hidden_layers": 2}
# LongRoPE: one factor per rotary pair (head_dim 16: 8); Phi-4-mini's partial rotary (0.75: 12 of 16)
LONG = {"short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0], "long_factor": [1.0, 1.5, 2, 3, 4, 6, 8, 12]}



class _Sdpa(ArchitectureConformance):
    def llm_options(self) -> dict[str, Any]:
        return {"model_impl": self.backend, "attention": {"backend": "sdpa"}}


class _Paged(ArchitectureConformance):
    def llm_options(self) -> dict[str, Any]:
        return {"model_impl": self.backend, "attention": {"backend": "paged"}}

    def llm(self, path, **overrides: Any) -> Any:
        """``paged`` reads the paged layout only: the kit's contiguous runs take paged blocks of 16."""
        if overrides.get("kvcache", {}).get("backend", "contiguous") == "contiguous":
            overrides["kvcache"] = {**overrides.get("kvcache", {}), "backend": "paged", "block_size": 16}
        return super().llm(path, **overrides)


GEMMA_CONFIGS = {
    "gemma2": GEMMA2,
    "gemma2-softcaps": {**GEMMA2, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0,
                        "tie_word_embeddings": False},
    "gemma3": GEMMA3,
    "gemma3-scaled-rope": {**GEMMA3, "num_key_value_heads": 4, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}}},
}
SMOLLM3_CONFIGS = {
    "smollm3": {**BASE, "model_type": "smollm3", "num_hidden_layers": 4, "no_rope_layer_interval": 2},
    "smollm3-default-nope": {**BASE, "model_type": "smollm3", "num_hidden_layers": 4, "tie_word_embeddings": False},
}
OLMO2_CONFIGS = {
    "olmo2": {**BASE, "model_type": "olmo2"},
    "olmo2-mha": {**BASE, "model_type": "olmo2", "num_key_value_heads": 4, "tie_word_embeddings": True},
}
GRANITE_CONFIGS = {
    "granite": {**BASE, "model_type": "granite", "embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.1, "logits_scaling": 2.5},
    "granite-plain": {**BASE, "model_type": "granite"},
}
PHI3_CONFIGS = {
    "phi3": PHI3,
    # the original context (16) is below the prompt: the long factors everywhere, as transformers
    "phi3-longrope-long": {**PHI3, "original_max_position_embeddings": 16, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, **LONG, "original_max_position_embeddings": 16}},
    # the original context (256) above max_model_len: the short factors
    "phi4mini-partial-short": {**PHI3, "original_max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": LONG["short_factor"][:6], "long_factor": LONG["long_factor"][:6],
        "original_max_position_embeddings": 256}},
}


FAMILY_CONFIGS = {"gemma": GEMMA_CONFIGS, "smollm3": SMOLLM3_CONFIGS, "olmo2": OLMO2_CONFIGS,
                  "granite": GRANITE_CONFIGS, "phi3": PHI3_CONFIGS}

for _name, _configs in FAMILY_CONFIGS.items():  # TestGemmaSdpa, TestGemmaPaged, ...
    for _mode in (_Sdpa, _Paged):
        _cls = type(f"Test{_name.title()}{_mode.__name__[1:]}", (_mode,), {"backend": _name, "configs": _configs})
        globals()[_cls.__name__] = _cls
