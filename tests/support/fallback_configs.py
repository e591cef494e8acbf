"""Tiny HF configs of the families the transformers fallback must serve (a helper module).

Each turns on its family's peculiarities at a size that runs in a few seconds: per-layer
sliding windows shorter than the test prompts (24 tokens), soft-caps, sinks, scales."""

from __future__ import annotations

from typing import Any

BASE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False,
}

FAMILIES: dict[str, dict[str, Any]] = {
    # soft-capped attention and logits, query_pre_attn_scalar != head_dim, 1:1 local/global
    "gemma2": {"model_type": "gemma2", "sliding_window": 8, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 24},
    "gemma3": {"model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": 24,
               "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"model_type": "phi3", "head_dim": None, "tie_word_embeddings": False},
    "olmo2": {"model_type": "olmo2"},
    # embedding, residual, attention and logit multipliers
    "granite": {"model_type": "granite", "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.2, "logits_scaling": 4.0},
    "glm4": {"model_type": "glm4", "partial_rotary_factor": 0.5},
    "cohere2": {"model_type": "cohere2", "sliding_window": 8, "logit_scale": 0.5,
                "layer_types": ["sliding_attention", "full_attention"]},
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 0]},
    "gpt_oss": {"model_type": "gpt_oss", "sliding_window": 8, "num_local_experts": 4,
                "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"]},
}


def config(family: str, **extra: Any) -> dict[str, Any]:
    spec = {**BASE, **FAMILIES[family], **extra}
    return {k: v for k, v in spec.items() if v is not None}
