"""``TransformersArchitecture``: the fallback for checkpoints no native architecture serves."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from lmplug.api import Architecture, CacheLayout, Capabilities, ConfigReader, ModelConfig
from lmplug.errors import ModelLoadError

CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")
# Why encoders are refused here: this fallback runs a model through the engine's causal step (prompts
# prefilled in chunks, prefixes shared); the native encoders (architecture 'bert') are scheduled whole.
ENCODER = ("model_type {model_type!r} is an encoder (bidirectional attention) that no native architecture "
           "serves (lmplug embeds bert, roberta and xlm-roberta natively); embed it with sentence-transformers "
           "(SentenceTransformer(path).encode), or "
           "embed with lmplug from a decoder-based embedding checkpoint (last-token pooling, e.g. "
           "Qwen3-Embedding, gte-Qwen2, e5-mistral), whose sentence-transformers pooling config it follows")
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "attention", "chunked_attention"})


def _transformers_missing() -> bool:
    return importlib.util.find_spec("transformers") is None


class TransformersArchitecture(Architecture):
    name = "transformers"
    # no tensor_parallel, gguf, mtp, state_layers, mla: the plan refuses those options
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), features=frozenset(), priority=0)
    fallback = True

    @classmethod
    def cannot_serve(cls, hf_config: Mapping[str, Any]) -> str | None:
        if _transformers_missing():
            return "transformers is not installed (pip install transformers)"
        model_type = hf_config.get("model_type")
        if hf_config.get("auto_map"):
            return "the checkpoint needs remote code (config.json 'auto_map'), which lmplug does not run"
        if hf_config.get("is_encoder_decoder"):
            return f"model_type {model_type!r} is an encoder-decoder, not a decoder-only causal LM"
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )

        if model_type not in CONFIG_MAPPING_NAMES:
            return f"transformers does not know model_type {model_type!r}"
        # BERT-likes have an LM-head class too (BertLMHeadModel), but their checkpoints are encoders
        encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not hf_config.get("is_decoder")
        heads = [a for a in hf_config.get("architectures") or () if isinstance(a, str)]
        if encoder:
            why = f"architectures {heads[0]!r} is not a causal LM head; " if heads else ""
            return why + ENCODER.format(model_type=model_type)
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return f"model_type {model_type!r} is not a causal LM in transformers"
        if heads and not any(a.endswith(CAUSAL_HEADS) for a in heads):
            return f"architectures {heads[0]!r} is not a causal LM head (expected ...ForCausalLM)"
        return cls._unsupported_feature(hf_config)

    @staticmethod
    def _unsupported_feature(hf_config: Mapping[str, Any]) -> str | None:
        model_type = hf_config.get("model_type")
        kinds = set(hf_config.get("layer_types") or ()) - ATTENTION_LAYERS
        if kinds:
            return (f"model_type {model_type!r} has state layers ({', '.join(sorted(kinds))}), which the "
                    "transformers fallback cannot cache (option: state_layers)")
        if hf_config.get("kv_lora_rank"):
            return f"model_type {model_type!r} uses multi-head latent attention (option: mla), not in the fallback"
        if hf_config.get("quantization_config"):
            return (f"model_type {model_type!r}: the fallback loads plain weights only; the checkpoint's "
                    "'quantization_config' needs a native architecture")
        return None

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        cfg = dict(hf_config)
        reason = self.cannot_serve(cfg)
        if reason is not None:
            raise ModelLoadError(f"{where}: architecture 'transformers' cannot serve it: {reason}")
        r = ConfigReader(cfg, where)
        hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
        kv_heads = r.int("num_key_value_heads", heads)
        if heads % kv_heads:
            r.fail("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
        head_dim = r.int("head_dim", None) or hidden // heads
        return ModelConfig(
            model_type=r.text("model_type"), vocab_size=r.int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.int("intermediate_size", hidden * 4), num_layers=r.int("num_hidden_layers"),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=r.number("rms_norm_eps", 1e-6),
            max_position_embeddings=r.int("max_position_embeddings", 2048),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            sliding_window=uniform_window(cfg), hidden_act=str(cfg.get("hidden_act") or "silu"), raw=cfg)

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        # the backend's scale; layers with another one are computed by the reference path
        return CacheLayout(model_config.num_kv_heads, model_config.head_dim, model_config.head_dim ** -0.5)

    def build(self, model_config: ModelConfig, *, dtype: Any, quant: Any, attention: Any,
              max_model_len: int, parallel: Any, moe: Any = None, mixer: Any = None) -> Any:
        if parallel is not None and getattr(parallel, "is_parallel", False):
            raise ModelLoadError(f"architecture 'transformers' (model_type {model_config.model_type!r}) does "
                                 "not support tensor parallelism (option parallel.tensor_parallel_size)")
        if quant is not None and getattr(quant, "name", "none") not in ("none", "unquantized"):
            raise ModelLoadError(f"architecture 'transformers' (model_type {model_config.model_type!r}) runs "
                                 f"plain weights only; quant method {quant.name!r} needs a native architecture")
        from lmplug_transformers.module import TransformersCausalLM

        return TransformersCausalLM(dict(model_config.raw), dtype, attention)


def uniform_window(cfg: Mapping[str, Any]) -> int | None:
    """The sliding window when every layer has it (the KV cache may then drop what falls out of
    it); None when some layer attends globally (Gemma 2/3, GPT-OSS, Cohere2: per-layer windows
    are applied by the attention function, over a cache that keeps everything)."""
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or cfg.get("use_sliding_window") is False:
        return None
    kinds = set(cfg.get("layer_types") or ("sliding_attention",))
    return window if kinds == {"sliding_attention"} else None
