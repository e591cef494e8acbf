"""What a drafter's trainer may use of the core (``Drafter.train(host, model, out, options)``).

``lmplug train-drafter`` hands the drafter a ``TrainingHost``; the trainer opens the target
model through it and gets a ``TrainingTarget``: the loaded model, its tokenizer, and the
engine's continuous batching (``generate``) and one-forward feature extraction
(``hidden_states``), so a trainer needs nothing of the engine beyond this contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lmplug.interfaces.model_config import ModelConfig
    from lmplug.interfaces.params import SamplingParams


@runtime_checkable
class TrainingTarget(Protocol):
    """A target model loaded for training a drafter."""

    model: torch.nn.Module  # forward(input_ids, positions, ctx) -> hidden, compute_logits(hidden)
    model_config: ModelConfig
    tokenizer: Any | None

    def chat_prompt(self, text: str) -> list[int]:
        """``text`` as one user message in the model's chat template; plainly encoded when the
        tokenizer has no template; ``ConfigError`` when the model has no tokenizer."""
        ...

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_tokens: Callable[[int], None] | None = None) -> list[list[int]]:
        """Run every prompt to completion through the engine (continuous batching): the output
        token ids per prompt, in order. ``on_tokens(n)`` after each step per request that got
        ``n`` new tokens (a progress bar)."""
        ...

    def hidden_states(self, ids: list[int]) -> torch.Tensor:
        """The target's final (normed) hidden states [T, h] over ``ids``: one prefill forward,
        its KV freed after."""
        ...


@runtime_checkable
class TrainingHost(Protocol):
    """Opens target models for a drafter's trainer."""

    def open_target(self, model: str, *, device: str, dtype: str, max_model_len: int,
                    max_num_seqs: int) -> TrainingTarget:
        """Load ``model`` (cache name, HF folder, GGUF) on ``device`` ("auto", "cpu", "cuda") in
        ``dtype`` ("float32", "bfloat16", ...) with a continuous-batching engine."""
        ...
