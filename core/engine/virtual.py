"""Micro-batches for pipeline parallelism (vLLM's virtual engines): P schedulers over one KV cache.

With ``parallel.pipeline_parallel_size: P`` the engine keeps up to P batches in flight, each
scheduled by its own scheduler from a disjoint set of sequences (a request goes to the scheduler
with the fewest), so that stage 1 works on batch B while stage 2 works on batch A. They share
the KV cache: every scheduler allocates blocks from the one pool rank 0 hands out. The engine
visits them in turn: it first collects the turn's batch in flight (the last stage's logits, then
select and commit), then schedules and submits its next one; the turns keep the order in which
the stages return batches. ``VirtualSchedulers`` is what the rest of the engine sees as its
scheduler (requests added, aborted, counted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmplug.interfaces.scheduler import Scheduler
from lmplug.interfaces.sequence import Sequence
from lmplug.kit import kv_extras


class VirtualSchedulers:
    """``count`` schedulers like ``base`` (which keeps no sequences), each with its share of the
    sequences (``max_num_seqs``, so of the state slots too) and of the KV blocks (``KVShare``)."""

    def __init__(self, base: Scheduler, count: int) -> None:
        cls, limits, blocks = type(base), base.limits, kv_extras.pool_blocks(base.kv)
        self.members = [cls(base.options, base.kv if blocks is None else KVShare(base.kv, _share(blocks, count, i)),
                            dataclasses.replace(limits, max_num_seqs=_share(limits.max_num_seqs, count, i)))
                        for i in range(count)]
        self._next = 0

    def turn(self) -> int:
        """The scheduler whose batch is collected and scheduled now (round robin)."""
        turn, self._next = self._next, (self._next + 1) % len(self.members)
        return turn

    def add(self, seq: Sequence) -> None:
        min(self.members, key=lambda m: m.num_running + m.num_waiting).add(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        return [seq for member in self.members for seq in member.abort(request_id)]

    def has_unfinished(self) -> bool:
        return any(member.has_unfinished() for member in self.members)

    @property
    def num_running(self) -> int:
        return sum(member.num_running for member in self.members)

    @property
    def num_waiting(self) -> int:
        return sum(member.num_waiting for member in self.members)

    def __getattr__(self, name: str) -> Any:  # capabilities, limits, options: the first's
        return getattr(self.members[0], name)


def _share(total: int, count: int, index: int) -> int:
    """Scheduler ``index``'s part of ``total`` (the remainder to the first ones; at least 1)."""
    return max(1, total // count + (1 if index < total % count else 0))


class KVShare:
    """One scheduler's view of the shared KV cache: it may hold at most ``blocks`` of the pool's
    blocks (counted from its sequences' block tables), so that a scheduler with nothing running
    is never starved by the others' sequences (it would take the pool for too small and fail its
    request). Everything else is the cache's."""

    def __init__(self, kv, blocks: int) -> None:
        self.kv, self.blocks = kv, blocks
        self._held: dict[int, int] = {}  # seq_id -> blocks in its table

    def _needs(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.kv.block_size) - self._held.get(seq.seq_id, 0))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return (sum(self._held.values()) + self._needs(seq, num_tokens) <= self.blocks
                and self.kv.can_allocate(seq, num_tokens))

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        cached = self.kv.allocate(seq, num_tokens)
        self._held[seq.seq_id] = len(self.kv.block_table(seq))
        return cached

    def free(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self._held.pop(seq.seq_id, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)
