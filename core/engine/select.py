"""The select stage: which tokens each sequence emits from the step's logits.

Two implementations with the same methods, called by ``LLMEngine.step`` in this order:
``propose(seqs) -> lookahead`` before scheduling, ``plan(scheduled)`` after it,
``select(logits, num_rows, seqs, hidden) -> (tokens, rows)`` after the forward, ``settle(seqs)``
once the tokens are appended; ``release(seq)`` when a sequence ends early and ``stats()`` for the
step's report. ``Sampler`` (here) draws one token per sequence; ``lmplug.speculation.Speculator``
drafts, verifies and rolls back.
"""

from __future__ import annotations

import torch

from lmplug.interfaces.sampling import sample
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.sequence import Sequence


class Sampler:
    """No speculation: nothing to propose or plan, one sampled token per sequence."""

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        return {}

    def plan(self, scheduled: list[ScheduledSeq]) -> None:
        pass

    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None) -> tuple[list[list[int]], list[list[int]]]:
        tokens = sample(logits, seqs)
        return [[t] for t in tokens], [[i] for i in range(len(tokens))]

    def settle(self, seqs: list[Sequence]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def stats(self) -> dict:
        return {}
