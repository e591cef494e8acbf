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

from typing import Any

from lmplug.interfaces.scheduler import Scheduler
from lmplug.interfaces.sequence import Sequence


class VirtualSchedulers:
    def __init__(self, first: Scheduler, count: int) -> None:
        cls = type(first)
        self.members = [first, *(cls(first.options, first.kv, first.limits) for _ in range(count - 1))]
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
