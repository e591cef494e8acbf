"""``static``: first-come first-served batches that run to completion.

The baseline for continuous batching: a batch is admitted only when the
previous one has fully finished, so short requests wait for the longest one.
Prompts are computed in chunks within the token budget, then the whole batch
decodes together.

Admission rule: a batch must run to completion without preemption, so a sequence joins it
only if the whole batch fits the KV cache at its final length, each sequence's prompt plus
``max_tokens`` (``max_model_len`` when unset), capped at ``max_model_len``; n > 1 siblings
forked later count their own growth. With a block pool that is the sum of each sequence's
blocks (``ceil(final_len / block_size)``) against the pool's free blocks, prefix hits not
counted; with one row per sequence (contiguous) a free row.
"""

from __future__ import annotations

from collections import deque

from lmplug_scheduler.running_batch import RunningBatch

from lmplug.api import Capabilities, ScheduledSeq, SchedulerOutput, Sequence
from lmplug.kit import kv_extras


class StaticScheduler(RunningBatch):
    name = "static"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), features=frozenset({"fork"}), priority=10)

    def __init__(self, options, kv, limits) -> None:
        super().__init__(options, kv, limits)
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        if not self.running:
            self._admit()
        budget = self.limits.max_num_batched_tokens
        out = SchedulerOutput()
        for seq in self.running:
            if budget == 0:
                break
            n = min(self.num_pending(seq), budget)
            if seq.whole_prompt and n < self.num_pending(seq):
                continue  # an encoder's prompt runs whole: in a later step, with the budget free
            self.kv.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _admit(self) -> None:
        free, reserved = self._free_blocks(), 0
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            # a batch must be able to run to completion without preemption
            need = self._blocks_needed(seq)
            if not self.kv.can_allocate(seq, self._final_len(seq)) or (
                    free is not None and reserved + need > free):
                if not self.running:
                    raise RuntimeError(f"KV cache backend {self.kv.name!r} cannot hold sequence "
                                       f"{seq.seq_id} of request {seq.request_id!r} even alone")
                break
            reserved += need
            self.waiting.popleft()
            cached = self.kv.allocate(seq, seq.num_tokens)
            seq.skip_cached(cached)
            seq.start_running()
            self.running.append(seq)

    def _free_blocks(self) -> int | None:
        """Free blocks of a block pool (None: the cache has no shared pool)."""
        blocks = kv_extras.pool_blocks(self.kv)
        return None if blocks is None else round(blocks * (1 - self.kv.usage))

    def _blocks_needed(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds at its final length, plus the growth of siblings that will fork
        from it (n > 1 with forking: they are not in the queue, they share its prompt)."""
        size = self.kv.block_size
        final = -(-self._final_len(seq) // size)
        forks = seq.params.n - 1 if seq.index == 0 and not any(
            s.request_id == seq.request_id and s.index > 0 for s in self.waiting) else 0
        return final + forks * (final - seq.num_prompt_tokens // size)

    def _final_len(self, seq: Sequence) -> int:
        max_new = seq.params.max_tokens or self.limits.max_model_len
        return min(seq.num_prompt_tokens + max_new, self.limits.max_model_len)

    def _drop_waiting(self, request_id: str) -> list[Sequence]:
        dropped = [s for s in self.waiting if s.request_id == request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        return dropped

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
