"""A dense decoder's float tensors by layer, for the methods that need no calibration (``rtn``,
``fp8``): they read and replace weights only, so they serve the families ``FloatLlama`` cannot
run (Gemma 2/3, SmolLM3, OLMo 2, Granite, Phi-3 with its fused ``qkv_proj`` / ``gate_up_proj``).
Each layer's linear layers are its 2-D ``*_proj`` tensors, as the checkpoint names them."""

from __future__ import annotations

import re

import torch
from lmplug_quant.quantizers.reference import SUPPORTED, FloatLlama

from lmplug.api import ModelConfig, ModelSource
from lmplug.errors import ConfigError

# dense decoders whose linear layers are their ``model.layers.N.*_proj`` tensors
DENSE = (*SUPPORTED, "gemma2", "gemma3_text", "smollm3", "olmo2", "granite", "phi3")
_LINEAR = re.compile(r"model\.layers\.0\.((?:self_attn|mlp)\.\w+_proj)\.weight")


class DecoderWeights:
    """``tensors``: HF name -> float32 tensor; ``linears``: the names of each layer's linear layers."""

    def __init__(self, source: ModelSource) -> None:
        model_type = source.hf_config.get("model_type")
        if model_type not in DENSE:
            raise ConfigError(f"{source.path}: offline quantization without calibration supports dense "
                              f"decoders ({', '.join(DENSE)}); this one is {model_type!r}")
        self.cfg = ModelConfig.from_hf(source.hf_config, **SUPPORTED.get(model_type, {}))
        self.tensors = {name: t.float() for name, t in source.iter_tensors() if "rotary_emb" not in name}
        self.linears = tuple(sorted(m.group(1) for name in self.tensors if (m := _LINEAR.fullmatch(name))
                                    and self.tensors[name].dim() == 2))

    def weight(self, layer: int, linear: str) -> torch.Tensor:
        return self.tensors[f"model.layers.{layer}.{linear}.weight"]


def float_model(source: ModelSource, calibrated: bool, max_len: int) -> FloatLlama | DecoderWeights:
    """What a method works on: the runnable Llama twin when it calibrates, else the weights."""
    return FloatLlama(source, max_len=max_len) if calibrated else DecoderWeights(source)
