"""Schedulers: decide which sequences run this step and how many tokens each computes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.kvcache import KVCacheBackend

if TYPE_CHECKING:
    import torch

    from lmplug.interfaces.sequence import Sequence


class SchedulerOptions(BackendOptions):
    """Limits every scheduler honours; backends subclass this for their own options."""

    max_num_seqs: int = Field(default=8, ge=1, description="sequences in one step")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="new tokens in one step")


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens token_ids[num_computed : num_computed + num_new_tokens]
    # Set after scheduling by whoever picks the next tokens (the engine's select stage), read by
    # the runner; the defaults are a plain causal query. ``positions``: each new token's position
    # (None: num_computed + j); a speculative draft tree puts siblings at the same position.
    positions: list[int] | None = None
    # bool [n, n]: new token a attends to new token b where mask[a, b] (the cached context always);
    # None: causal. Its K/V still goes to the slot of position num_computed + j
    mask: torch.Tensor | None = None
    # when the sequence catches up: how many of its last rows need logits (1 + verified drafts)
    num_logit_rows: int = 1
    # what the select stage hands the model for this row (``StepContext.row_inputs``), e.g. a
    # block-diffusion decoder's self-conditioning; None: nothing
    inputs: Any = None


def samples_now(item: ScheduledSeq) -> bool:
    """The scheduled sequence catches up this step, so the step samples its next token (with
    speculative drafts appended to ``token_ids``, ``num_new_tokens`` counts them too)."""
    return item.seq.num_computed_tokens + item.num_new_tokens >= item.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler(ABC):
    """Policy apart from accounting: the scheduler owns the queues and asks the
    KV backend (``can_allocate`` / ``allocate`` / ``free``) whether things fit.

    A sequence whose ``num_computed_tokens`` reaches ``len(token_ids)`` after
    a step gets a new token sampled; the engine then calls ``update``.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = SchedulerOptions
    # read-only default; ``set_lookahead`` replaces it on the instance
    _lookahead: Mapping[int, int] = MappingProxyType({})

    def __init__(self, options: SchedulerOptions, kv: KVCacheBackend, limits: SchedulerLimits) -> None:
        self.options = options
        self.kv = kv
        self.limits = limits

    @classmethod
    def features_for(cls, options: SchedulerOptions) -> frozenset[str]:
        """The features these options use: ``capabilities.features`` plus any an option turns on
        ("swap": preemption swaps K/V out, which the plan refuses under tensor parallelism)."""
        return cls.capabilities.features

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""

    def add_running(self, seq: Sequence) -> None:
        """Take a sequence that already holds KV straight into the running set.

        Used for ``SamplingParams.n > 1`` when the KV backend can fork: the
        engine queues only a request's first sequence; when it samples its first
        token, the engine creates the siblings with ``kv.fork(parent, child)``
        (they share the prompt's blocks), gives each its own first token and
        hands them here. Such a sequence has ``num_computed_tokens ==
        num_prompt_tokens`` and one token to compute; the scheduler must neither
        re-admit it nor allocate its prompt again (its next ``kv.allocate``
        grows it, copying a shared partial block), and may preempt it like any
        running sequence. Only a scheduler listing the ``"fork"`` feature in its
        ``capabilities`` gets forks; for any other the engine runs ``n``
        independent sequences.
        """
        raise NotImplementedError(f"scheduler {self.name!r} cannot take forked sequences")

    def set_lookahead(self, lookahead: Mapping[int, int]) -> None:
        """Before ``schedule``: seq_id -> tokens the step may compute past ``token_ids``."""
        self._lookahead = lookahead

    def lookahead(self, seq: Sequence) -> int:
        """Tokens past ``seq.token_ids`` this step may also compute for ``seq`` (speculative
        drafts, which only the engine knows). They count against the token budget and the KV
        cache like the others, and may be cut: any prefix of them can be scheduled."""
        return self._lookahead.get(seq.seq_id, 0)

    def num_pending(self, seq: Sequence) -> int:
        """Tokens ``seq`` could compute this step: the uncomputed ones plus its lookahead."""
        return seq.num_tokens + self.lookahead(seq) - seq.num_computed_tokens

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the limits and the KV cache."""

    @abstractmethod
    def update(self, finished: list[Sequence]) -> None:
        """Called after each step with the sequences that finished in it."""

    @abstractmethod
    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of ``request_id`` and free its KV; returns them."""

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    def has_unfinished(self) -> bool:
        return self.num_waiting + self.num_running > 0
