"""GGUF files of tiny transformers models of Gemma 2/3, SmolLM3, OLMo 2, Granite and Phi-3, written
as llama.cpp's ``convert_hf_to_gguf.py`` writes them (a helper module, not a test file).

The metadata follows each family's converter class (``conversion/gemma.py``: ``Gemma2Model``,
``Gemma3Model``; ``llama.py``: ``SmolLM3Model``; ``olmo.py``: ``Olmo2Model``; ``granite.py``:
``GraniteModel``; ``phi.py``: ``Phi3MiniModel``, and ``TextModel.set_gguf_parameters`` where a
class calls it); the tensor names come from gguf-py's own map (``get_tensor_name_map``, which the
converter uses), with the converter's changes: Gemma's norm weights stored as ``1 + w`` (and
Gemma 2's ``lm_head`` dropped), Q/K rows permuted for the families converted as Llama, Phi-3's
LongRoPE factors as tensors. 2-D weights are written in ``qtype``; 1-D ones in F32, as the
converter does. ``quantized_reference`` is the transformers model with each 2-D weight replaced by
what the file holds, dequantized: the reference for the quantized files.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from support.gguf_fixtures import add_byte_level_vocab, train_byte_level

GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3", "smollm3": "smollm3", "olmo2": "olmo2",
             "granite": "granite", "phi3": "phi3"}
_ARCH_ENUM = {"gemma2": MODEL_ARCH.GEMMA2, "gemma3": MODEL_ARCH.GEMMA3, "smollm3": MODEL_ARCH.SMOLLM3,
              "olmo2": MODEL_ARCH.OLMO2, "granite": MODEL_ARCH.GRANITE, "phi3": MODEL_ARCH.PHI3}
PERMUTED = ("smollm3", "granite")  # LlamaModel subclasses: Q/K rows permuted
GEMMA = ("gemma2", "gemma3")


def _base(vocab: int) -> dict[str, Any]:
    return {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def family_configs(vocab: int) -> dict[str, dict[str, Any]]:
    """Configs the converter represents: Gemma's ``query_pre_attn_scalar`` is ``head_dim`` (llama.cpp
    derives the scale from the size), Gemma 2 tied with soft-caps (its converter drops ``lm_head``
    and writes both caps), Gemma 3's default 5:1 windows."""
    base = _base(vocab)
    long = {"short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0], "long_factor": [1.0, 1.5, 2, 3, 4, 6, 8, 12]}
    phi3 = {**base, "model_type": "phi3", "num_hidden_layers": 2, "original_max_position_embeddings": 256}
    return {
        "gemma2": {**base, "model_type": "gemma2", "sliding_window": 8, "query_pre_attn_scalar": 16,
                   "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0},
        "gemma3": {**base, "model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 8,
                   "query_pre_attn_scalar": 16},
        "gemma3-scaled-rope": {**base, "model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 8,
                               "query_pre_attn_scalar": 16, "final_logit_softcapping": 5.0, "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}}},
        "smollm3": {**base, "model_type": "smollm3", "num_hidden_layers": 4},
        "olmo2": {**base, "model_type": "olmo2"},
        "granite": {**base, "model_type": "granite", "embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                    "attention_multiplier": 0.1, "logits_scaling": 2.5},
        "phi3": phi3,
        # the original context (16) below the prompt: LongRoPE's long factors, as transformers
        "phi3-longrope": {**phi3, "original_max_position_embeddings": 16, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, **long, "original_max_position_embeddings": 16}},
        # Phi-4-mini's partial rotary (12 of 16), short factors
        "phi4mini-partial": {**phi3, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": long["short_factor"][:6], "long_factor": long["long_factor"][:6],
            "original_max_position_embeddings": 256}},
    }


FAMILIES = ("gemma2", "gemma3", "smollm3", "olmo2", "granite", "phi3")  # one config each


def vocab_size() -> int:
    """The byte-level vocabulary the files carry (the tiny models' ``vocab_size``)."""
    return len(train_byte_level()[0])


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``LlamaModel.permute``: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """``TextModel.__init__``'s ``rope_parameters``: transformers 5's, or the old keys mirrored."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "full_attention" not in params and "rope_theta" not in params and hf.get("rope_theta") is not None:
        params["rope_theta"] = hf["rope_theta"]
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key not in params and hf.get(key) is not None and "full_attention" not in params:
            params[key] = hf[key]
    if "sliding_attention" not in params and hf.get("rope_local_base_freq") is not None:
        params["sliding_attention"] = {"rope_theta": hf["rope_local_base_freq"]}
    return params


def _text_model_params(w: GGUFWriter, hf: dict[str, Any], rope: dict[str, Any]) -> None:
    """``TextModel.set_gguf_parameters`` for the keys these configs have."""
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear" and full.get("factor") is not None:
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if rope.get("sliding_attention", {}).get("rope_theta") is not None:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if hf.get("head_dim") is not None:
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])


def _params(w: GGUFWriter, arch: str, hf: dict[str, Any], rope: dict[str, Any]) -> None:
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters (no TextModel call: no RoPE base)
        for add, key in ((w.add_context_length, "max_position_embeddings"), (w.add_embedding_length, "hidden_size"),
                         (w.add_feed_forward_length, "intermediate_size"), (w.add_head_count, "num_attention_heads"),
                         (w.add_head_count_kv, "num_key_value_heads"), (w.add_layer_norm_rms_eps, "rms_norm_eps"),
                         (w.add_key_length, "head_dim"), (w.add_value_length, "head_dim"),
                         (w.add_attn_logit_softcapping, "attn_logit_softcapping"),
                         (w.add_final_logit_softcapping, "final_logit_softcapping"),
                         (w.add_sliding_window, "sliding_window")):
            add(hf[key])
        w.add_block_count(hf["num_hidden_layers"])
        return
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        w.add_context_length(hf["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(hf["intermediate_size"])
        w.add_block_count(hf["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(hf["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(hf.get("sliding_window") or 0)
        return
    _text_model_params(w, hf, rope)
    if arch == "gemma3":
        if hf.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        if hf.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hf["sliding_window"])
    if arch in ("smollm3", "granite"):  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(hf["vocab_size"])
        w.add_rope_dimension_count(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    if arch == "granite":
        for add, key in ((w.add_attention_scale, "attention_multiplier"), (w.add_embedding_scale, "embedding_multiplier"),
                         (w.add_residual_scale, "residual_multiplier"), (w.add_logit_scale, "logits_scaling")):
            if hf.get(key):
                add(hf[key])


def _rope_factors(hf: dict[str, Any], rope: dict[str, Any]) -> dict[str, np.ndarray]:
    """``Phi3MiniModel.generate_extra_tensors``: LongRoPE's factors (and its attention factor)."""
    if not rope.get("long_factor"):
        return {}
    return {"rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32)}


def write_family_gguf(hf_model: Any, path: Path, qtype: Q = Q.F32) -> Path:
    """``hf_model`` (a tiny transformers model of one of the families) as a GGUF at ``path``."""
    hf = hf_model.config.to_dict()
    if "head_dim" in hf and hf.get("model_type") == "granite":
        hf.pop("head_dim")  # GraniteModel ignores it
    arch = GGUF_ARCH[hf["model_type"]]
    rope = _rope(hf)
    writer = GGUFWriter(str(path), arch)
    add_byte_level_vocab(writer)
    _params(writer, arch, hf, rope)
    factors = _rope_factors(hf, rope) if arch == "phi3" else {}
    if factors:
        scale = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    names = get_tensor_name_map(_ARCH_ENUM[arch], hf["num_hidden_layers"])
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    for name, tensor in hf_model.state_dict().items():
        if arch == "gemma2" and name == "lm_head.weight":
            continue  # Gemma2Model.filter_tensors
        if name == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue  # tied: not in the safetensors the converter reads
        data = tensor.detach().float().clone()
        if arch in GEMMA and name.endswith("norm.weight"):
            data = data + 1
        if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_permute(data, heads)
        if arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_permute(data, kv_heads)
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, f"gguf-py maps no {arch} tensor to {name}"
        values = data.numpy()
        if values.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(new_name, quantize(values, qtype), raw_dtype=qtype if qtype != Q.F16 else None)
        else:
            writer.add_tensor(new_name, values)
    for name, values in factors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantized_reference(hf_model: Any, qtype: Q) -> Any:
    """A copy of ``hf_model`` whose 2-D weights are what a ``qtype`` file holds, dequantized (rows
    quantize independently, so the Q/K permutation does not change them)."""
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                values = p.detach().float().numpy()
                p.copy_(torch.from_numpy(dequantize(quantize(values, qtype), qtype).reshape(values.shape).copy()))
    return model.eval()
