"""A GGUF file's header as an architecture reads it: the llama.cpp metadata and tensor names.

A GGUF carries no ``config.json``: its metadata is the config, under llama.cpp's key names
(``{arch}.embedding_length`` ...), and its tensors have llama.cpp's names (``blk.3.attn_q``).
The loader chooses the architecture that declares the file's ``general.architecture``
(``Architecture.gguf_architectures``) and asks it for the HF config (``gguf_config``) and each
tensor's HF name (``gguf_tensor_name``). ``decoder_config`` and ``decoder_tensor_name`` are the
standard decoder's translation (llama.cpp writes Llama, Qwen2, Qwen3 ... alike), which an
architecture calls and amends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmplug.errors import ModelLoadError

_MISSING = object()


@dataclass(frozen=True)
class GGUFHeader:
    """``arch``: ``general.architecture``; ``tensors``: name -> dims in GGUF order (ne0 first);
    ``quantized``: some 2-D layer weight is block-quantized (not F32/F16/BF16), or some expert tensor
    is MXFP4; ``vectors``: the
    values of the 1-D float tensors outside the blocks other than ``output_norm`` (settings stored
    as tensors: Phi-3's LongRoPE factors ``rope_factors_long`` / ``rope_factors_short``)."""

    where: str  # the file, named in every error
    arch: str
    metadata: Mapping[str, Any]
    tensors: Mapping[str, tuple[int, ...]]
    quantized: bool
    vectors: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def key(self, name: str, default: Any = _MISSING) -> Any:
        """``{arch}.{name}``; missing without a default: a ``ModelLoadError`` naming it."""
        value = self.metadata.get(f"{self.arch}.{name}", None if default is _MISSING else default)
        if value is None:
            raise ModelLoadError(f"{self.where}: GGUF metadata lacks required key '{self.arch}.{name}'")
        return value


_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def decoder_tensor_name(gguf_name: str, where: str = "<gguf>", layers: Mapping[str, str] | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (the standard decoder's
    tensors); ``layers``: a family's own layer tensor names, or other meanings of standard ones
    (Gemma's ``ffn_norm`` is ``pre_feedforward_layernorm``). Any other name is a ``ModelLoadError``
    naming it."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        stem, suffix = gguf_name, ""
    parts = stem.split(".")
    names = {**_LAYER_NAMES, **layers} if layers else _LAYER_NAMES
    hf_stem = None
    if len(parts) == 1:
        hf_stem = _GLOBAL_NAMES.get(parts[0])
    elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        hf_stem = f"model.layers.{parts[1]}.{names[parts[2]]}"
    if hf_stem is None:
        hint = " (llama3-style RoPE scaling is not supported yet)" if stem == "rope_freqs" else ""
        raise ModelLoadError(f"{where}: tensor {gguf_name!r} has no known HF equivalent{hint}")
    return f"{hf_stem}.{suffix}" if suffix else hf_stem


def decoder_config(header: GGUFHeader, hf_class: str, model_type: str | None = None) -> dict[str, Any]:
    """The HF ``config.json`` equivalent of the standard decoder keys of a GGUF's metadata:
    sizes, RoPE (and its scaling), tied embeddings, special tokens, and ``quantization_config``
    naming the ``gguf`` quant method when layer weights are block-quantized."""
    tensors = header.tensors
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{header.where}: GGUF has no 'token_embd.weight' tensor")
    hidden = int(header.key("embedding_length"))
    heads = int(header.key("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type or header.arch,
        "vocab_size": int(tensors["token_embd.weight"][1]),
        "hidden_size": hidden,
        "intermediate_size": int(header.key("feed_forward_length")),
        "num_hidden_layers": int(header.key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.key("attention.head_count_kv", heads)),
        "head_dim": int(header.key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(header.key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(header.key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(header.key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",  # dense tensors are dequantized to float32
    }
    if header.quantized:
        # the `gguf` quant method multiplies by the packed blocks (chosen like any checkpoint's)
        config["quantization_config"] = {"quant_method": "gguf"}
    rope_scaling = _rope_scaling(header)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in header.metadata:
            config[hf_key] = int(header.metadata[f"tokenizer.ggml.{gguf_key}"])
    return config


def _rope_scaling(header: GGUFHeader) -> dict | None:
    kind = header.metadata.get(f"{header.arch}.rope.scaling.type")
    factor = header.metadata.get(f"{header.arch}.rope.scaling.factor")
    if kind in (None, "none") and factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind or "linear"}
    if factor is not None:
        scaling["factor"] = float(factor)
    original = header.metadata.get(f"{header.arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
