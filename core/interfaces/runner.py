"""What a forward over a batch of scheduled sequences returns, and the runner drafters get.

``StepResult`` is the engine's model runner's result; ``ForwardRunner`` is the part of that
runner a drafter may drive over a model and KV cache of its own (``DraftTarget.new_runner``):
build a step's inputs (``build_context``) or run a whole step (``execute``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.step import StepContext


@dataclass
class StepResult:
    sample_rows: list[ScheduledSeq]  # sequences that caught up and get a new token
    logits: torch.Tensor | None  # [sum(num_rows), V], each sequence's rows consecutive
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits [n, V])
    # rows per sample_rows entry: 1 + its draft tokens (the last accepted token and every draft)
    num_rows: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [sum(num_rows), h], the rows behind `logits` (keep_hidden)
    # embedding sequences (``Sequence.pooling``): seq_id -> (first position, final hidden states [n, h])
    pooled: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


@runtime_checkable
class ForwardRunner(Protocol):
    """One forward over a batch, on a model bound to a KV cache (``model.bind_kv`` at creation).

    Sequences are allocated in that cache by the caller before each call, and their
    ``num_computed_tokens`` advanced by the caller after it.
    """

    model: torch.nn.Module

    def build_context(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, StepContext]:
        """The batch flattened (decodes first, in ``batch``'s order otherwise): input ids [T] and
        the step's ``StepContext`` (positions, slots, block tables), on the runner's device."""
        ...

    def execute(self, batch: list[ScheduledSeq]) -> StepResult:
        """The forward over the batch's new tokens; logits of the sequences that caught up
        (``sample_rows``, their rows of ``logits`` in that order)."""
        ...
