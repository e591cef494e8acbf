"""The engine's select stages and the router over them: each sequence belongs to the first stage
that claims its request's params (beam groups to ``BeamStage``; every other sequence to the
speculator when a drafter is configured, else to the sampler), and each stage gets its own rows
of the step's logits. The engine calls the router as one ``SelectStage`` and never asks which
stage it holds."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from lmplug.beam.stage import BeamStage
from lmplug.constraints import Constraints
from lmplug.diffusion.stage import DenoisingStage
from lmplug.engine.select import Sampler
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.select import OnError, SelectStage
from lmplug.interfaces.sequence import Sequence
from lmplug.speculative import Speculator
from lmplug.speculative.draft_length import DraftLength


def build_select_stages(parts, constraints: Constraints, requests, *, can_fork: bool) -> SelectStages:
    """Block diffusion first (every request to a block-diffusion model, and denoising requests to
refuse), beam groups, then the speculator (``parts.drafter``) or the sampler for the rest."""
    default: SelectStage
    if parts.drafter is not None:
        draft_length = DraftLength() if parts.drafter.options.draft_length == "cost" else None
        default = Speculator(parts.drafter, parts.drafter.options.num_tokens, parts.kv, parts.max_model_len,
                             constraints, parts.eos_token_ids, rule=parts.acceptance, draft_length=draft_length)
    else:
        default = Sampler(constraints, parts.eos_token_ids)
    beam = BeamStage(parts.kv, requests, parts.eos_token_ids, parts.max_model_len, parts.tokenizer,
                     max_num_seqs=parts.kv.spec.max_num_seqs, can_fork=can_fork,
                     speculative=parts.drafter is not None, constraints=constraints)
    denoise = DenoisingStage(parts.model, parts.kv, parts.model_config.vocab_size, parts.max_model_len,
                             parts.scheduler.limits.max_num_batched_tokens, parts.model_config.model_type)
    return SelectStages([denoise, beam, default])


class SelectStages:
    """A ``SelectStage`` over ``stages``: the last one claims whatever the others do not."""

    def __init__(self, stages: list[SelectStage]) -> None:
        self.stages = stages

    def find(self, kind: type) -> Any:
        """The stage of type ``kind``, or None (``LLMEngine.speculator`` for tests and reports)."""
        return next((s for s in self.stages if isinstance(s, kind)), None)

    def stage_of(self, params: SamplingParams) -> SelectStage:
        return next((s for s in self.stages[:-1] if s.claims(params)), self.stages[-1])

    def _split(self, seqs: list[Sequence]) -> list[tuple[SelectStage, list[int]]]:
        """Each stage with the indices of its sequences in ``seqs`` (possibly none: a stage's
        ``propose`` and ``settle`` run every step, as they reset what one step holds)."""
        parts: dict[int, list[int]] = {id(s): [] for s in self.stages}
        for i, seq in enumerate(seqs):
            parts[id(self.stage_of(seq.params))].append(i)
        return [(s, parts[id(s)]) for s in self.stages]

    def claims(self, params: SamplingParams) -> bool:
        return True

    def admit(self, params: SamplingParams) -> None:
        self.stage_of(params).admit(params)

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        lookahead: dict[int, int] = {}
        for stage, part in self._split(seqs):
            lookahead.update(stage.propose([seqs[i] for i in part]))
        return lookahead

    def plan(self, scheduled: list[ScheduledSeq]) -> None:
        for stage, part in self._split([item.seq for item in scheduled]):
            stage.plan([scheduled[i] for i in part])

    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None, on_error: OnError | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]:
        split = [(stage, part) for stage, part in self._split(seqs) if part]
        if len(split) <= 1:  # one stage holds the whole step: its rows are the logits as they are
            stage = split[0][0] if split else self.stages[-1]
            return stage.select(logits, num_rows, seqs, hidden, on_error)
        starts = [0, *itertools.accumulate(num_rows)]
        tokens: list[list[int]] = [[] for _ in seqs]
        rows: list[list[int]] = [[] for _ in seqs]
        for stage, part in split:
            index = [r for i in part for r in range(starts[i], starts[i + 1])]
            got, got_rows = stage.select(logits[index], [num_rows[i] for i in part], [seqs[i] for i in part],
                                         None if hidden is None else hidden[index], on_error)
            for i, t, r in zip(part, got, got_rows):
                tokens[i], rows[i] = t, [index[j] for j in r]
        return tokens, rows

    def settle(self, seqs: list[Sequence]) -> None:
        for stage, part in self._split(seqs):
            stage.settle([seqs[i] for i in part])

    def release(self, seq: Sequence) -> None:
        self.stage_of(seq.params).release(seq)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for stage in self.stages:
            out.update(stage.stats())
        return out

    def annotate(self, outputs: list[Any]) -> None:
        for stage in self.stages:
            stage.annotate(outputs)
