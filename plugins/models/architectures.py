"""The first-party architectures as ``Architecture`` backends of the ``model`` family.

Each one declares the ``config.json`` model types it serves and builds its module
(``lmplug_models.llama`` etc.); ``lmplug_models.plugin`` registers them through the entry-point
group ``lmplug.plugins``, as a third-party architecture package would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from lmplug_models.deepseek_v2 import DeepseekV2ForCausalLM
from lmplug_models.llama import LlamaForCausalLM
from lmplug_models.mamba2 import Mamba2ForCausalLM
from lmplug_models.minimax import MiniMaxForCausalLM
from lmplug_models.moe import MoEForCausalLM
from lmplug_models.qwen3_next import Qwen3NextForCausalLM

from lmplug.api import (
    GGUF,
    MLA,
    MTP,
    PACKED_WEIGHTS,
    STATE_LAYERS,
    TENSOR_PARALLEL,
    Architecture,
    Capabilities,
    ModelConfig,
)

NATIVE_PRIORITY = 10  # above any fallback (priority 0)
_ANY = frozenset({"cpu", "cuda"})


def _caps(*features: str) -> Capabilities:
    return Capabilities(devices=_ANY, features=frozenset(features), priority=NATIVE_PRIORITY)


class _Native(Architecture):
    """An architecture whose module is one of lmplug's own model classes."""

    module: ClassVar[type[torch.nn.Module]]

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        return ModelConfig.from_hf(dict(hf_config), where)

    def build(self, model_config: ModelConfig, *, dtype: Any, quant: Any, attention: Any,
              max_model_len: int, parallel: Any, moe: Any = None, mixer: Any = None) -> torch.nn.Module:
        extra = {name: backend for name, backend in (("moe", moe), ("mixer", mixer)) if backend is not None}
        return self.module(model_config, dtype, quant, attention, max_model_len, parallel=parallel, **extra)


class LlamaArchitecture(_Native):
    """Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k norms)."""

    name = "llama"
    module = LlamaForCausalLM
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    gguf_architectures = ("llama", "qwen2", "qwen3")
    capabilities = _caps(TENSOR_PARALLEL, GGUF, PACKED_WEIGHTS, MTP)


class MoEArchitecture(_Native):
    """Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE."""

    name = "moe"
    module = MoEForCausalLM
    model_types = ("mixtral", "qwen2_moe", "qwen3_moe")
    capabilities = _caps(TENSOR_PARALLEL, MTP)


class DeepseekV2Architecture(_Native):
    """DeepSeek-V2/V3: multi-head latent attention and routed + shared experts."""

    name = "deepseek_v2"
    module = DeepseekV2ForCausalLM
    model_types = ("deepseek_v2", "deepseek_v3")
    capabilities = _caps(TENSOR_PARALLEL, MLA, MTP)


class Mamba2Architecture(_Native):
    """Mamba2: a pure state-space model."""

    name = "mamba2"
    module = Mamba2ForCausalLM
    model_types = ("mamba2",)
    capabilities = _caps(TENSOR_PARALLEL, STATE_LAYERS)


class MiniMaxArchitecture(_Native):
    """MiniMax-Text: lightning attention layers between softmax ones, MoE."""

    name = "minimax"
    module = MiniMaxForCausalLM
    model_types = ("minimax",)
    capabilities = _caps(TENSOR_PARALLEL, STATE_LAYERS)


class Qwen3NextArchitecture(_Native):
    """Qwen3-Next: gated DeltaNet layers between gated softmax ones, MoE, an MTP module."""

    name = "qwen3_next"
    module = Qwen3NextForCausalLM
    model_types = ("qwen3_next",)
    capabilities = _caps(TENSOR_PARALLEL, STATE_LAYERS, MTP)


FIRST_PARTY: tuple[type[Architecture], ...] = (
    LlamaArchitecture, MoEArchitecture, DeepseekV2Architecture, Mamba2Architecture,
    MiniMaxArchitecture, Qwen3NextArchitecture,
)
