"""Architectures, chosen by ``config.json``'s ``model_type``."""

from __future__ import annotations

from lmplug.errors import ModelLoadError
from lmplug.models.deepseek_v2 import DeepseekV2ForCausalLM
from lmplug.models.llama import LlamaForCausalLM
from lmplug.models.mamba2 import Mamba2ForCausalLM
from lmplug.models.minimax import MiniMaxForCausalLM
from lmplug.models.moe import MoEForCausalLM
from lmplug.models.qwen3_next import Qwen3NextForCausalLM

ARCHITECTURES: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": MoEForCausalLM,
    "qwen2_moe": MoEForCausalLM,
    "qwen3_moe": MoEForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV2ForCausalLM,  # the same MLA; V3's routing differs only in moe_config
    "mamba2": Mamba2ForCausalLM,
    "minimax": MiniMaxForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}


def architecture_for(model_type: str | None) -> type:
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"model_type {model_type!r} is not supported; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type]


__all__ = [
    "ARCHITECTURES",
    "DeepseekV2ForCausalLM",
    "LlamaForCausalLM",
    "Mamba2ForCausalLM",
    "MiniMaxForCausalLM",
    "MoEForCausalLM",
    "Qwen3NextForCausalLM",
    "architecture_for",
]
