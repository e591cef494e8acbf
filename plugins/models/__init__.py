"""The first-party architectures' modules; ``architectures.py`` declares them as backends of the
``model`` family and ``plugin.py`` registers them (the engine finds them through the registry)."""

from __future__ import annotations

from lmplug_models.deepseek_v2 import DeepseekV2ForCausalLM
from lmplug_models.llama import LlamaForCausalLM
from lmplug_models.mamba2 import Mamba2ForCausalLM
from lmplug_models.minimax import MiniMaxForCausalLM
from lmplug_models.moe import MoEForCausalLM
from lmplug_models.qwen3_next import Qwen3NextForCausalLM

__all__ = [
    "DeepseekV2ForCausalLM",
    "LlamaForCausalLM",
    "Mamba2ForCausalLM",
    "MiniMaxForCausalLM",
    "MoEForCausalLM",
    "Qwen3NextForCausalLM",
]
