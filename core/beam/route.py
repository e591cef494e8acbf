"""The engine's select stage with beam search beside it: beam groups go to ``BeamStage``, every
other sequence to the sampler or the speculator, each with its own rows of the step's logits."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from lmplug.beam.stage import BeamStage, is_beam
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.sequence import Sequence


class SelectRouter:
    def __init__(self, inner, beam: BeamStage) -> None:
        self.inner = inner
        self.beam = beam

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        return self.inner.propose([s for s in seqs if not is_beam(s)])

    def plan(self, scheduled: list[ScheduledSeq]) -> None:
        self.inner.plan([item for item in scheduled if not is_beam(item.seq)])

    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]:
        beams = [i for i, s in enumerate(seqs) if is_beam(s)]
        if not beams:
            return self.inner.select(logits, num_rows, seqs, hidden, on_error)
        starts = [0, *itertools.accumulate(num_rows)]
        tokens: list[list[int]] = [[] for _ in seqs]
        rows: list[list[int]] = [[] for _ in seqs]
        for part, stage in ((beams, self.beam), ([i for i in range(len(seqs)) if i not in set(beams)], self.inner)):
            if not part:
                continue
            index = [r for i in part for r in range(starts[i], starts[i + 1])]
            got, got_rows = stage.select(logits[index], [num_rows[i] for i in part], [seqs[i] for i in part],
                                         None if hidden is None else hidden[index], on_error)
            for i, t, r in zip(part, got, got_rows):
                tokens[i], rows[i] = t, [index[j] for j in r]
        return tokens, rows

    def settle(self, seqs: list[Sequence]) -> None:
        self.inner.settle([s for s in seqs if not is_beam(s)])

    def release(self, seq: Sequence) -> None:
        (self.beam if is_beam(seq) else self.inner).release(seq)

    def stats(self) -> dict:
        return self.inner.stats()
