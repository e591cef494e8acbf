"""The select stage: which tokens each sequence emits from the step's logits.

Two implementations with the same methods, called by ``LLMEngine.step`` in this order:
``propose(seqs) -> lookahead`` before scheduling, ``plan(scheduled)`` after it,
``select(logits, num_rows, seqs, hidden, on_error) -> (tokens, rows)`` after the forward (with
``on_error``, a sequence whose tokens cannot be chosen is reported there, the others go on), ``settle(seqs)``
once the tokens are appended; ``release(seq)`` when a sequence ends early and ``stats()`` for the
step's report. ``Sampler`` (here) draws one token per sequence; ``lmplug.speculation.Speculator``
drafts, verifies and rolls back.
"""

from __future__ import annotations

from collections.abc import Callable

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
               hidden: torch.Tensor | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]:
        """One token per sequence. If the batch raises and ``on_error`` is given, one sequence at
        a time: a sequence whose row raises gets no token and goes to ``on_error``; the others
        get what the batch would give (``sample`` shapes every row before it draws any, so a
        batch that raised drew nothing and no generator moved)."""
        try:
            tokens = sample(logits, seqs)
            return [[t] for t in tokens], [[i] for i in range(len(tokens))]
        except Exception:
            if on_error is None:
                raise
        out: list[list[int]] = []
        for i, seq in enumerate(seqs):
            try:
                out.append(sample(logits[i:i + 1], [seq])[:1])
            except Exception as exc:  # noqa: BLE001  (reported to on_error, which logs it)
                on_error(seq, exc)
                out.append([])
        return out, [[i] for i in range(len(seqs))]

    def settle(self, seqs: list[Sequence]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def stats(self) -> dict:
        return {}
