"""A dense decoder's float tensors by layer, for the methods that need no calibration (``rtn``,
``fp8``): they read and replace weights only, so they serve the families ``FloatLlama`` cannot
run (Gemma 2/3, SmolLM3, OLMo 2, Granite, Phi-3 with its fused ``qkv_proj`` / ``gate_up_proj``).
Each layer's linear layers are its 2-D ``*_proj`` tensors, as the checkpoint names them.

GPT-OSS (``STACKED_EXPERTS``) is read the same way: its attention projections, and its experts,
which transformers stacks (``mlp.experts.gate_up_proj [E, in, out]``, ``down_proj``), split into
one linear layer per expert (``mlp.experts.gate_up_proj.{e}``, ``[out, in]``, the names lmplug's
``gpt_oss`` loads quantized experts by); their stacked biases stay float. An MXFP4 checkpoint
is refused (its experts are already 4-bit: requantizing them would add a second rounding), and
so is a GGUF one (llama.cpp's files store gate and up apart, in MXFP4)."""

from __future__ import annotations

import re

import torch
from lmplug_quant.quantizers.reference import SUPPORTED, FloatLlama

from lmplug.api import ModelConfig, ModelSource
from lmplug.errors import ConfigError

# dense decoders whose linear layers are their ``model.layers.N.*_proj`` tensors
DENSE = (*SUPPORTED, "gemma2", "gemma3_text", "smollm3", "olmo2", "granite", "phi3")
_LINEAR = re.compile(r"model\.layers\.0\.((?:self_attn|mlp)\.(?:experts\.\w+_proj\.\d+|\w+_proj))\.weight")
# MoE decoders whose experts are stacked ``[E, in, out]`` (transformers' GPT-OSS)
STACKED_EXPERTS = ("gpt_oss",)
_STACKED = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)")


class DecoderWeights:
    """``tensors``: HF name -> float32 tensor; ``linears``: the names of each layer's linear layers."""

    def __init__(self, source: ModelSource) -> None:
        model_type = source.hf_config.get("model_type")
        if model_type not in (*DENSE, *STACKED_EXPERTS):
            raise ConfigError(f"{source.path}: offline quantization without calibration supports dense "
                              f"decoders ({', '.join(DENSE)}) and {', '.join(STACKED_EXPERTS)}; this one is "
                              f"{model_type!r}")
        if model_type in STACKED_EXPERTS:
            _check_experts(source, model_type)
        self.cfg = ModelConfig.from_hf(source.hf_config, **SUPPORTED.get(model_type, {}))
        self.tensors = {}
        for name, t in source.iter_tensors():
            if "rotary_emb" in name:
                continue
            if _STACKED.fullmatch(name) and t.dim() == 3:  # [E, in, out] -> one [out, in] weight per expert
                self.tensors.update((f"{name}.{e}.weight", t[e].t().float().contiguous()) for e in range(t.shape[0]))
                continue
            self.tensors[name] = t.float()
        self.linears = tuple(sorted(m.group(1) for name in self.tensors if (m := _LINEAR.fullmatch(name))
                                    and self.tensors[name].dim() == 2))

    def weight(self, layer: int, linear: str) -> torch.Tensor:
        return self.tensors[f"model.layers.{layer}.{linear}.weight"]


def _check_experts(source: ModelSource, model_type: str) -> None:
    """ConfigError for a checkpoint whose experts are already quantized (MXFP4)."""
    method = (source.hf_config.get("quantization_config") or {}).get("quant_method")
    if source.format == "gguf" or method == "mxfp4":
        what = "a GGUF file" if source.format == "gguf" else "an MXFP4 checkpoint (quant_method: mxfp4)"
        raise ConfigError(f"{source.path}: {model_type}: this is {what}, whose experts are already 4-bit MXFP4; "
                          "quantizing them again would add a second rounding. Quantize the float (bf16) "
                          "checkpoint, or serve this one as it is (quant method mxfp4 / gguf keep the "
                          "experts packed)")


def float_model(source: ModelSource, calibrated: bool, max_len: int) -> FloatLlama | DecoderWeights:
    """What a method works on: the runnable Llama twin when it calibrates, else the weights."""
    return FloatLlama(source, max_len=max_len) if calibrated else DecoderWeights(source)
