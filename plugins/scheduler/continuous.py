"""``continuous``: iteration-level scheduling with chunked prefill and preemption.

Every step: running sequences first (decodes, then unfinished prompt chunks),
then waiting ones are admitted while the token budget
(``max_num_batched_tokens``), the sequence limit (``max_num_seqs``) and the
KV cache allow. A finished sequence leaves at once, so the batch stays full.

Chunked prefill: a prompt longer than what is left of the budget is split;
its chunks share steps with the running decodes, which therefore never stall
behind a long prompt.

Preemption: when the KV cache cannot grow a running sequence, the lowest-priority
one (the newest under FCFS) gives back all its blocks and returns to the front of
the queue. By recomputation (``preemption: recompute``, the default) it restarts
with ``num_computed_tokens = 0`` and later recomputes its prompt and the tokens it
already generated in one prefill; by swapping (``preemption: swap``, a KV cache with
the "swap" feature) its K/V (and state) are copied out of the pool and come back
when it is admitted again, so it continues where it stopped. Either way its output
does not change. A sequence the swap space cannot take is recomputed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Literal

from lmplug_scheduler.running_batch import RunningBatch
from pydantic import Field

from lmplug.api import Capabilities, ScheduledSeq, SchedulerOptions, SchedulerOutput, Sequence
from lmplug.errors import ConfigError
from lmplug.kit import kv_extras


class ContinuousOptions(SchedulerOptions):
    policy: Literal["fcfs", "priority"] = Field(
        default="fcfs", description="fcfs: arrival order; priority: lower `priority` value first, then arrival")
    chunked_prefill: bool = Field(default=True, description="split long prompts across steps (false: max_num_batched_tokens must be >= max_model_len)")
    preemption: Literal["recompute", "swap"] = Field(
        default="recompute", description="what a preempted sequence loses: recompute = its K/V (computed "
                                         "again on return); swap = nothing (K/V copied out and back)")


class _Waiting:
    """The waiting queue, ordered by (priority, turn, arrival) or by (turn, arrival).

    Fair admission: a sequence's turn is how many sequences of its request were queued before
    it, so at equal priority requests are served round-robin (every request's first sequence,
    then every request's second, ...) and a request with many samples cannot starve a later,
    smaller one. Requests of one sequence each keep strict arrival order; priority still wins.
    """

    def __init__(self, by_priority: bool) -> None:
        self._by_priority = by_priority
        self._heap: list[tuple[tuple, Sequence]] = []
        self._tie = itertools.count()
        self._turn: dict[int, int] = {}  # seq_id -> its turn (kept across preemptions)
        self._queued: dict[str, int] = {}  # request_id -> sequences queued so far

    def push(self, seq: Sequence) -> None:
        # A preempted sequence keeps its place: its turn and arrival rank it before (FCFS) or
        # above (priority) everything of its turn that is still waiting.
        turn = self._turn.get(seq.seq_id)
        if turn is None:
            turn = self._turn[seq.seq_id] = self._queued.get(seq.request_id, 0)
            self._queued[seq.request_id] = turn + 1
        rank = (seq.priority, turn, seq.arrival_time) if self._by_priority else (turn, seq.arrival_time)
        heapq.heappush(self._heap, ((*rank, next(self._tie)), seq))

    def forget(self, seq: Sequence) -> None:
        """``seq`` left for good (finished or aborted)."""
        if self._turn.pop(seq.seq_id, None) is not None and seq.index == 0:
            self._queued.pop(seq.request_id, None)

    def peek(self) -> Sequence:
        return self._heap[0][1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, request_id: str) -> list[Sequence]:
        gone = [s for _, s in self._heap if s.request_id == request_id]
        for seq in gone:
            self.forget(seq)
        if gone:
            self._heap = [(k, s) for k, s in self._heap if s.request_id != request_id]
            heapq.heapify(self._heap)
        return gone

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (s for _, s in self._heap)


class ContinuousScheduler(RunningBatch):
    name = "continuous"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}),
                                features=frozenset({"chunked_prefill", "preemption", "priority", "fork"}),
                                priority=20)
    Options = ContinuousOptions

    @classmethod
    def features_for(cls, options: ContinuousOptions) -> frozenset[str]:
        return cls.capabilities.features | ({"swap"} if options.preemption == "swap" else set())

    def __init__(self, options: ContinuousOptions, kv, limits) -> None:
        if options.preemption == "swap" and "swap" not in kv.capabilities.features:
            raise ConfigError(f"scheduler: continuous: preemption: swap needs a kvcache backend with the "
                              f"'swap' feature; {kv.name!r} has {sorted(kv.capabilities.features)}: use "
                              "`kvcache: paged` or `preemption: recompute`")
        if not options.chunked_prefill and limits.max_num_batched_tokens < limits.max_model_len:
            # a whole prompt (or a preempted sequence's whole recompute) must fit one step's budget
            raise ConfigError(f"scheduler: continuous: chunked_prefill: false needs max_num_batched_tokens "
                              f"({limits.max_num_batched_tokens}) >= the context limit max_model_len "
                              f"({limits.max_model_len}): raise scheduler.max_num_batched_tokens, lower "
                              "max_model_len, or set chunked_prefill: true")
        super().__init__(options, kv, limits)
        self.waiting = _Waiting(options.policy == "priority")
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions that swapped the K/V out instead of dropping it

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        # decodes first: they are cheap and waiting for them is what users feel
        for seq in sorted(self.running, key=lambda s: s.is_prefill):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if not self._make_room(seq, seq.num_computed_tokens + n, out):
                continue  # seq itself was preempted
            self.kv.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        if not out.preempted:
            budget = self._admit(out, budget)
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = self.num_pending(seq)
        if remaining <= budget:
            return remaining
        # a decode may always be cut: past its one token it only has lookahead, any prefix of
        # which may run
        return budget if self._may_split(seq) or not seq.is_prefill else 0

    def _may_split(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt may run over several steps (never an encoder's: ``whole_prompt``)."""
        return self.options.chunked_prefill and not seq.whole_prompt

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt victims until ``seq`` can grow to ``num_tokens``; False if ``seq`` itself went."""
        while not self.kv.can_allocate(seq, num_tokens):
            victim = self._victim()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _victim(self) -> Sequence:
        if self.options.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_time))
        return max(self.running, key=lambda s: s.arrival_time)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        swapped = self.options.preemption == "swap" and kv_extras.swap_out(self.kv, seq)
        if swapped:
            self.num_swaps += 1  # keeps its computed tokens
        else:
            self.kv.free(seq)
        seq.requeue(recompute=not swapped)
        self.waiting.push(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        while len(self.waiting) and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting.peek()
            if kv_extras.is_swapped(self.kv, seq):
                if not self._swap_in(seq, out, budget):
                    break
                budget -= out.scheduled[-1].num_new_tokens
                continue
            first = min(seq.num_tokens, budget)
            if not self._may_split(seq) and seq.num_tokens > budget:
                break
            if not self.kv.can_allocate(seq, first):
                if not self.running and not out.scheduled:
                    raise RuntimeError(f"KV cache backend {self.kv.name!r} cannot hold {first} tokens of "
                                       f"request {seq.request_id!r} even with nothing else running")
                break
            self.waiting.pop()
            cached = self.kv.allocate(seq, first)
            seq.skip_cached(cached)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.num_computed_tokens + n > first:
                if self.kv.can_allocate(seq, seq.num_computed_tokens + n):
                    self.kv.allocate(seq, seq.num_computed_tokens + n)
                else:
                    n = max(first - seq.num_computed_tokens, 0)
            seq.start_running()
            self.running.append(seq)
            if n > 0:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return budget

    def _swap_in(self, seq: Sequence, out: SchedulerOutput, budget: int) -> bool:
        """Admit swapped-out ``seq``: its K/V back, then its next tokens; False if it does not fit.
        A sequence with nothing left to compute (a beam that was waiting for the rest of its
        group) runs its last token again: the step must give its logits once more, and a
        scheduled sequence without tokens would have no row."""
        rerun = self.num_pending(seq) == 0
        n = min(self.num_pending(seq) or 1, budget)
        if not self._may_split(seq) and self.num_pending(seq) > budget:
            return False
        total = seq.num_computed_tokens - rerun + n
        if not self.kv.can_allocate(seq, total):
            if not self.running and not out.scheduled:
                raise RuntimeError(f"KV cache backend {self.kv.name!r} cannot hold {total} "
                                   f"tokens of request {seq.request_id!r} even with nothing else running")
            return False
        self.waiting.pop()
        self.kv.swap_in(seq)
        seq.rewind(seq.num_computed_tokens - rerun)
        self.kv.allocate(seq, seq.num_computed_tokens + n)
        seq.start_running()
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, n))
        return True

    # -- bookkeeping -----------------------------------------------------------------------------
    def update(self, finished: list[Sequence]) -> None:
        for seq in finished:
            self.waiting.forget(seq)
        super().update(finished)

    def abort(self, request_id: str) -> list[Sequence]:
        dropped = super().abort(request_id)
        for seq in dropped:
            self.waiting.forget(seq)
        return dropped

    def _drop_waiting(self, request_id: str) -> list[Sequence]:
        return self.waiting.remove(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
