"""The first-party architectures' modules; ``architectures.py`` declares them as backends of the
``model`` family and ``plugin.py`` registers them (the engine finds them through the registry)."""

from __future__ import annotations

from lmplug.models.deepseek_v2 import DeepseekV2ForCausalLM
from lmplug.models.llama import LlamaForCausalLM
from lmplug.models.mamba2 import Mamba2ForCausalLM
from lmplug.models.minimax import MiniMaxForCausalLM
from lmplug.models.moe import MoEForCausalLM
from lmplug.models.qwen3_next import Qwen3NextForCausalLM

__all__ = [
    "DeepseekV2ForCausalLM",
    "LlamaForCausalLM",
    "Mamba2ForCausalLM",
    "MiniMaxForCausalLM",
    "MoEForCausalLM",
    "Qwen3NextForCausalLM",
]
