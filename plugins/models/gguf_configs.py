"""llama.cpp's GGUF files of Gemma 2/3, SmolLM3, OLMo 2, Granite and Phi-3 as HF configs.

Each function reads a file's metadata as llama.cpp's loader does (``src/models/<arch>.cpp``: the
same keys, the same defaults where a key is missing) and writes the ``config.json`` the family's
architecture parses; the tensor name tables give the family's own llama.cpp names. What
``convert_hf_to_gguf.py`` does not store is what llama.cpp assumes: Gemma's softmax scale from the
model size, SmolLM3's NoPE layer every fourth.
"""

from __future__ import annotations

from typing import Any

from lmplug.api import GGUFHeader, decoder_config
from lmplug.errors import ModelLoadError

SLIDING, FULL = "sliding_attention", "full_attention"

# llama.cpp layer tensor -> HF module, where a family differs from the standard decoder
GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
OLMO2_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _opt(header: GGUFHeader, name: str) -> Any:
    """``{arch}.{name}`` or None where the file lacks it."""
    return header.metadata.get(f"{header.arch}.{name}")


def _base(header: GGUFHeader, hf_class: str, model_type: str) -> dict[str, Any]:
    config = decoder_config(header, hf_class, model_type)
    config["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
    config["mlp_bias"] = False
    return config


def _swa_kinds(header: GGUFHeader, layers: int, pattern: int) -> list[str]:
    """Each layer's kind: ``attention.sliding_window_pattern`` as a per-layer list of flags, or an
    interval n (every n-th layer global; llama.cpp's ``set_swa_pattern``), default ``pattern``."""
    raw = header.metadata.get(f"{header.arch}.attention.sliding_window_pattern", pattern)
    if isinstance(raw, (list, tuple)):
        if len(raw) != layers:
            raise ModelLoadError(f"{header.where}: '{header.arch}.attention.sliding_window_pattern' lists "
                                 f"{len(raw)} layers; the model has {layers} (block_count)")
        return [SLIDING if flag else FULL for flag in raw]
    n = int(raw)
    return [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(layers)]


def gemma_config(header: GGUFHeader) -> dict[str, Any]:
    """Gemma 2 / Gemma 3 text (``gemma2``, ``gemma3``): windows per layer (Gemma 2 1:1, Gemma 3 5:1
    unless the file lists them), soft-caps (Gemma 2: always on, 50 and 30 where unstated), the
    sliding layers' RoPE base, and the softmax scale llama.cpp derives from the size (27B:
    ``hidden / heads``, else ``head_dim``: ``query_pre_attn_scalar`` is not in the file)."""
    gemma3 = header.arch == "gemma3"
    config = _base(header, "Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM",
                   "gemma3_text" if gemma3 else "gemma2")
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    window = _opt(header, "attention.sliding_window") if gemma3 else header.key("attention.sliding_window", 4096)
    if window:
        kinds = _swa_kinds(header, layers, 6 if gemma3 else 2)
    else:  # Gemma 3 without a window: every layer global
        kinds, window = [FULL] * layers, None
    big = layers == (62 if gemma3 else 46)  # the 27B models
    config.update(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", sliding_window=window,
                  layer_types=kinds, query_pre_attn_scalar=hidden // heads if big else config["head_dim"],
                  final_logit_softcapping=(_opt(header, "final_logit_softcapping") or None) if gemma3
                  else float(header.key("final_logit_softcapping", 30.0)))
    swa_theta = header.key("rope.freq_base_swa", 10000.0 if gemma3 else config["rope_theta"])
    if gemma3:
        config["rope_local_base_freq"] = float(swa_theta)
    else:
        config["attn_logit_softcapping"] = float(header.key("attn_logit_softcapping", 50.0))
        if float(swa_theta) != config["rope_theta"]:  # transformers 5's per-kind RoPE
            full = {"rope_type": "default", "rope_theta": config["rope_theta"], **config.get("rope_scaling", {})}
            config["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": float(swa_theta)}}
    return config


def smollm3_config(header: GGUFHeader) -> dict[str, Any]:
    """SmolLM3: a NoPE layer every fourth (llama.cpp's fixed ``n_no_rope_layer_step``; the file
    does not say which)."""
    return {**_base(header, "SmolLM3ForCausalLM", "smollm3"), "no_rope_layer_interval": 4}


def olmo2_config(header: GGUFHeader) -> dict[str, Any]:
    """OLMo 2; OLMo 3's sliding-window layers (a window in the file) are not served natively."""
    window = header.key("attention.sliding_window", 0)
    if window:
        raise ModelLoadError(f"{header.where}: '{header.arch}.attention.sliding_window' is {window}: OLMo 3's "
                             "sliding-window layers are not supported by the olmo2 architecture")
    return _base(header, "Olmo2ForCausalLM", "olmo2")


def granite_config(header: GGUFHeader) -> dict[str, Any]:
    """Granite 3: the multipliers (``embedding_scale``, ``residual_scale``, ``attention.scale``;
    missing or 0: none) and the logit divisor ``logit_scale`` (required, as in llama.cpp)."""
    if not header.key("rope.scaling.finetuned", True):
        raise ModelLoadError(f"{header.where}: '{header.arch}.rope.scaling.finetuned' is false (Granite "
                             "without RoPE), which the granite architecture does not run")
    config = _base(header, "GraniteForCausalLM", "granite")
    config["logits_scaling"] = float(header.key("logit_scale"))
    for hf_key, key in (("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
                        ("attention_multiplier", "attention.scale")):
        value = header.key(key, 0.0)
        if value:
            config[hf_key] = float(value)
    return config


def phi3_config(header: GGUFHeader) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini: the rotated width (``rope.dimension_count``: partial rotary), the window
    (0: none), LongRoPE from the ``rope_factors_long`` / ``rope_factors_short`` tensors with the
    file's attention factor and original context."""
    config = _base(header, "Phi3ForCausalLM", "phi3")
    head_dim = config["head_dim"]
    rotary = int(header.key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    config["sliding_window"] = int(header.key("attention.sliding_window", 0)) or None
    original = _opt(header, "rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    long, short = (header.vectors.get(name) for name in PHI3_ROPE_FACTORS)
    if long is None and short is None:
        return config
    if long is None or short is None or original is None:
        raise ModelLoadError(f"{header.where}: LongRoPE needs both {' and '.join(PHI3_ROPE_FACTORS)} (F32 "
                             f"vectors) and '{header.arch}.rope.scaling.original_context_length'")
    scaling = {"rope_type": "longrope", "long_factor": list(long), "short_factor": list(short),
               "original_max_position_embeddings": int(original)}
    attention = _opt(header, "rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    config["rope_scaling"] = scaling
    return config
