"""The select stage: which tokens each sequence emits from the step's logits.

Implementations of ``lmplug.interfaces.select.SelectStage`` (when the engine calls each method:
there): ``Sampler`` (here) draws one token per sequence; ``lmplug.speculative.Speculator``
drafts, verifies and rolls back; ``lmplug.beam.stage.BeamStage`` steps beam groups.
``lmplug.engine.stages`` routes each sequence to one of them.

Both shape each row the same way before drawing (``lmplug.kit.sampling.sample``): penalties,
logit bias and ``min_tokens``, then the structured-output mask (``lmplug.constraints``; filled on a
worker thread while the forward runs), then temperature and the filters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmplug.constraints import Constraints
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq, samples_now
from lmplug.interfaces.sequence import Sequence
from lmplug.kit.penalties import PromptIds
from lmplug.kit.sampling import sample


class Sampler:
    """No speculation: nothing to propose, one sampled token per sequence."""

    def __init__(self, constraints: Constraints | None = None, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.constraints = constraints or Constraints(None, 0)
        self.eos_token_ids = eos_token_ids
        self._masks = None  # this step's mask job (lmplug.constraints), started in plan
        self._prompts = PromptIds()  # each penalised sequence's prompt, for the repetition penalty

    def claims(self, params: SamplingParams) -> bool:
        return True

    def admit(self, params: SamplingParams) -> None:
        pass

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        return {}

    def plan(self, scheduled: list[ScheduledSeq]) -> None:
        """Start filling the structured-output masks of the sequences that sample this step."""
        self._masks = self.constraints.start([item.seq for item in scheduled if samples_now(item)])

    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]:
        """One token per sequence. If the batch raises and ``on_error`` is given, one sequence at
        a time: a sequence whose row raises gets no token and goes to ``on_error``; the others
        get what the batch would give (``sample`` shapes every row before it draws any, so a
        batch that raised drew nothing and no generator moved)."""
        filled, self._masks = self.constraints.result(self._masks), None
        try:
            masks = self.constraints.assemble(seqs, [1] * len(seqs), filled)
            tokens = sample(logits, seqs, self.eos_token_ids, masks.bitmask, masks.rows, self._prompts)
            return [[t] for t in tokens], [[i] for i in range(len(tokens))]
        except Exception:
            if on_error is None:
                raise
        out: list[list[int]] = []
        for i, seq in enumerate(seqs):
            try:
                masks = self.constraints.assemble([seq], [1], filled)
                out.append(sample(logits[i:i + 1], [seq], self.eos_token_ids, masks.bitmask, masks.rows,
                                  self._prompts)[:1])
            except Exception as exc:  # noqa: BLE001  (reported to on_error, which logs it)
                on_error(seq, exc)
                out.append([])
        return out, [[i] for i in range(len(seqs))]

    def settle(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.is_finished:
                self.release(seq)

    def release(self, seq: Sequence) -> None:
        self.constraints.release(seq)
        self._prompts.release(seq)

    def stats(self) -> dict:
        return {}

    def annotate(self, outputs: list) -> None:
        pass
