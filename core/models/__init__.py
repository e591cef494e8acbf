"""Architectures, chosen by ``config.json``'s ``model_type``."""

from __future__ import annotations

from lmplug.errors import ModelLoadError
from lmplug.models.config import ModelConfig
from lmplug.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def architecture_for(model_type: str | None) -> type:
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"model_type {model_type!r} is not supported; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type]


__all__ = ["ARCHITECTURES", "ModelConfig", "architecture_for", "LlamaForCausalLM"]
