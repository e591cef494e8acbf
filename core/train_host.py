"""The core's ``TrainingHost`` (``lmplug.interfaces.training``): what ``lmplug train-drafter``
hands a drafter's trainer. A target is an ``LLM`` with a continuous-batching engine."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmplug.api import ScheduledSeq
from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence
from lmplug.llm import LLM


class LLMTrainingHost:
    """Opens targets as ``LLM``s (``max_model_len``, a continuous scheduler of ``max_num_seqs``)."""

    def open_target(self, model: str, *, device: str, dtype: str, max_model_len: int,
                    max_num_seqs: int) -> LLMTrainingTarget:
        llm = LLM(model, device=device, dtype=dtype, max_model_len=max_model_len,
                  scheduler={"backend": "continuous", "max_num_seqs": max_num_seqs})
        return LLMTrainingTarget(llm)


class LLMTrainingTarget:
    """A ``TrainingTarget`` over an ``LLM``'s engine."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.model = llm.engine.parts.model
        self.model_config = llm.engine.parts.model_config
        self.tokenizer = llm.tokenizer

    def chat_prompt(self, text: str) -> list[int]:
        if self.tokenizer is not None and self.tokenizer.chat_template:
            return self.llm.apply_chat_template([{"role": "user", "content": text}])
        if self.tokenizer is None:
            raise ConfigError("train-drafter: the model has no tokenizer to encode the instructions")
        return self.tokenizer.encode(text)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_tokens: Callable[[int], None] | None = None) -> list[list[int]]:
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        engine = self.llm.engine
        for i, (ids, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"train-{i}", ids, p)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if on_tokens is not None:
                    on_tokens(len(out.delta_token_ids))
                if out.finished:
                    done[out.request_id] = out
        return [list(done[f"train-{i}"].token_ids) for i in range(len(prompts))]

    def hidden_states(self, ids: list[int]) -> torch.Tensor:
        return hidden_states(self.llm.engine, ids)


@torch.inference_mode()
def hidden_states(engine, ids: list[int]) -> torch.Tensor:
    """The final (normed) hidden states [T, h] of ``engine``'s model over ``ids``: one prefill
    forward in its KV cache, freed after."""
    seq = Sequence("train-drafter", ids, SamplingParams())
    engine.kv.allocate(seq, len(ids))
    try:
        input_ids, ctx = engine.runner.build_context([ScheduledSeq(seq, len(ids))])
        return engine.runner.model(input_ids, ctx.positions, ctx).clone()
    finally:
        engine.kv.free(seq)
