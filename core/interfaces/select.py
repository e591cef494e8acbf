"""``SelectStage``: the step's select stage, the one party that decides which tokens a sequence emits.

``LLMEngine.step`` runs schedule -> run -> select -> commit and calls every select stage it holds
at the same points, in this order (each stage sees only the sequences it ``claims``):

- ``admit(params)`` when a request arrives: refuse (``ConfigError`` naming the field) what the
  stage cannot serve, before any state exists;
- ``propose(seqs) -> lookahead`` before scheduling: how many tokens past ``token_ids`` each
  sequence may compute this step (speculative drafts; ``{}`` for none);
- ``plan(scheduled)`` after scheduling: fill in the rows the scheduler gave (drafts, tree
  positions and masks, structured-output masks started);
- ``select(logits, num_rows, seqs, hidden, on_error) -> (tokens, rows)`` after the forward: per
  sequence the tokens to append and the logits row of each (for logprobs); with ``on_error``, a
  sequence whose tokens cannot be chosen is reported there and gets none, the others go on;
- ``settle(seqs)`` once the tokens are appended (roll back, release the finished);
- ``release(seq)`` when a sequence ends early (abort, a failed request);
- ``stats()`` for the step's report, and ``annotate(outputs)`` for what each request's metrics
  say about how its tokens were chosen (the acceptance rule under speculation).

The engine's stages (``lmplug.engine.stages``): beam groups (``lmplug.beam.stage.BeamStage``),
then either the speculator (``lmplug.speculative.Speculator``, with a drafter) or the sampler
(``lmplug.engine.select.Sampler``), which claims every sequence left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.sequence import Sequence

OnError = Callable[[Sequence, Exception], None]


@runtime_checkable
class SelectStage(Protocol):
    """What the engine calls on a select stage; see the module docstring for when."""

    def claims(self, params: SamplingParams) -> bool:
        """Whether sequences with these (the request's) params are this stage's."""
        ...

    def admit(self, params: SamplingParams) -> None: ...

    def propose(self, seqs: list[Sequence]) -> dict[int, int]: ...

    def plan(self, scheduled: list[ScheduledSeq]) -> None: ...

    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None, on_error: OnError | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]: ...

    def settle(self, seqs: list[Sequence]) -> None: ...

    def release(self, seq: Sequence) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def annotate(self, outputs: list[Any]) -> None: ...
