"""The architecture kit on the first-party ``llama`` and on the fallback serving the same configs
(``model_impl: transformers`` takes a checkpoint a native architecture also serves)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from lmplug.testing.architecture import ArchitectureConformance

pytestmark = pytest.mark.hf

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "initializer_range": 0.1, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True}


class TestKitOnNativeLlama(ArchitectureConformance):
    backend = "llama"
    configs: ClassVar[dict] = {"llama": LLAMA, "qwen3": QWEN3}


class TestFallbackOnLlama(ArchitectureConformance):
    backend = "transformers"
    configs: ClassVar[dict] = {"llama": LLAMA, "qwen3_tied": QWEN3}
