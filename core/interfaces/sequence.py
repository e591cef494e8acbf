"""``Sequence``: one generation stream (a request has ``n`` of them)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from lmplug.interfaces.params import SamplingParams

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


class SequenceView(Protocol):
    """What a backend may read of a sequence (``Sequence`` is one): the engine's stages own
    its writes; a scheduler moves it only through ``start_running`` / ``requeue`` / ``finish``."""

    @property
    def seq_id(self) -> int: ...
    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def status(self) -> SequenceStatus: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def is_finished(self) -> bool: ...
    @property
    def is_prefill(self) -> bool: ...
    @property
    def cache_salt(self) -> int | None: ...


class Sequence:
    """Tokens so far and how many of them have K/V computed.

    ``num_computed_tokens`` < ``num_tokens`` means work remains (prompt
    chunks, or a recompute after preemption); when a step brings it level,
    the engine samples the next token.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, index: int = 0, priority: int = 0, generator: torch.Generator | None = None,
                 arrival_time: float | None = None) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self._status = SequenceStatus.WAITING  # changed by the transitions below only
        self.params = params
        self.priority = priority
        self.generator = generator
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, Logprob]] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []
        self.text = ""
        # per-sequence statistics (speculative decoding fills the first two; RequestMetrics)
        self.num_drafted = 0  # proposals verified over the sequence's life
        self.num_accepted = 0  # of those, accepted
        self.num_target_forwards = 0  # target forwards (steps) that produced tokens for it
        # an embedding request (``lmplug.outputs.pooling``): prefill only, its final hidden states pooled
        # ("last", "mean" or "cls"), never sampled; None: a generation
        self.pooling: str | None = None
        self.pooling_normalize = True
        # computed in one step from its first token, never from a cached prefix (an encoder's
        # prompt: its attention looks both ways); schedulers must not split it
        self.whole_prompt = False
        # the LoRA adapter it runs with (``LoRARequest.lora_name``; None: the base model) and what
        # its prefix-cache hashes start from (None: the base's): K/V is shared only under one adapter
        self.adapter: str | None = None
        self.cache_salt: int | None = None

    # -- status: waiting -> running (a scheduler admits it) -> waiting (preempted) ... -> finished --
    @property
    def status(self) -> SequenceStatus:
        return self._status

    @status.setter
    def status(self, value: SequenceStatus) -> None:
        """(kept for plugins written before the named transitions; the core uses those)"""
        self._status = SequenceStatus(value)

    def start_running(self) -> None:
        """A scheduler admitted it: it runs from this step."""
        self._status = SequenceStatus.RUNNING

    def requeue(self, *, recompute: bool = False) -> None:
        """A scheduler preempted it: it waits to be admitted again; ``recompute``: its K/V was
        dropped, so every token is computed again."""
        self._status = SequenceStatus.WAITING
        if recompute:
            self.num_computed_tokens = 0

    def finish(self, reason: str | None = None, *, clear_stop_reason: bool = False,
               at: float | None = None) -> None:
        """It ends; ``reason`` (when given) is its ``finish_reason`` ("stop", "length", "abort",
        "error"; a stop check sets it before); ``clear_stop_reason`` drops a stop reason already
        set; ``at`` (``time.perf_counter()``), when given, is its ``finish_time``."""
        self._status = SequenceStatus.FINISHED
        if reason is not None:
            self.finish_reason = reason
        if clear_stop_reason:
            self.stop_reason = None
        if at is not None:
            self.finish_time = at

    # -- its tokens and computed count: written here only (``tools/contract_names.py --sequence``) --
    def advance(self, num_tokens: int) -> None:
        """A step computed ``num_tokens`` more of its tokens (the engine, after the forward)."""
        self.num_computed_tokens += num_tokens

    def rewind(self, num_tokens: int) -> None:
        """Its K/V holds its first ``num_tokens`` tokens only (rejected drafts, a swap-in's last
        token computed again, a drafter's copy brought in step with the target)."""
        self.num_computed_tokens = num_tokens

    def fork_from(self, parent: Sequence, *, outputs: bool = False) -> None:
        """It continues ``parent`` (the cache's ``fork`` shares or copies the K/V): the same
        computed count; ``outputs``: also its tokens and logprobs (a beam taking another's slot)."""
        if outputs:
            self.token_ids, self.logprobs = list(parent.token_ids), list(parent.logprobs)
        self.num_computed_tokens = parent.num_computed_tokens

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)

    def extend_tokens(self, tokens: Iterable[int]) -> None:
        self.token_ids.extend(tokens)

    def truncate_tokens(self, num_tokens: int) -> None:
        """Keep its first ``num_tokens`` tokens (drafts stripped after the verify)."""
        del self.token_ids[num_tokens:]

    def reset_tokens(self, token_ids: Iterable[int], num_computed: int) -> None:
        """Its tokens become ``token_ids``, of which ``num_computed`` have K/V (a drafter's copy
        of a target sequence, or a conformance harness's)."""
        self.token_ids = list(token_ids)
        self.num_computed_tokens = num_computed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to be computed."""
        return (self.params.prompt_logprobs is not None and self.num_computed_tokens < self.num_prompt_tokens
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    def skip_cached(self, num_cached: int) -> None:
        """Start computing after a prefix-cache hit of ``num_cached`` tokens.

        The last token is always computed (its logits give the next token), and a
        request that wants prompt logprobs computes its whole prompt.
        """
        if self.params.prompt_logprobs is not None or self.pooling in ("mean", "cls") or self.whole_prompt:
            num_cached = 0  # every prompt position's logits / hidden state is needed
        self.num_computed_tokens = min(num_cached, self.num_tokens - 1)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
