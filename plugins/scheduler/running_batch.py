"""``RunningBatch``: the bookkeeping both first-party schedulers share.

A running list, finishing sequences (their KV is freed at once), taking
forked siblings straight into the batch (so subclasses list the "fork" feature),
and aborts. Each scheduler keeps its
own waiting queue and says how to drop a request from it.
"""

from __future__ import annotations

from abc import abstractmethod

from lmplug.api import Scheduler, Sequence


class RunningBatch(Scheduler):
    def __init__(self, options, kv, limits) -> None:
        super().__init__(options, kv, limits)
        self.running: list[Sequence] = []

    @abstractmethod
    def _drop_waiting(self, request_id: str) -> list[Sequence]:
        """Remove and return the waiting sequences of ``request_id``."""

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the running batch (it already holds its prompt's KV)."""
        seq.start_running()
        self.running.append(seq)

    def update(self, finished: list[Sequence]) -> None:
        if not finished:
            return
        done = {s.seq_id for s in finished}
        for seq in finished:
            self.kv.free(seq)
        self.running = [s for s in self.running if s.seq_id not in done]

    def abort(self, request_id: str) -> list[Sequence]:
        dropped = [s for s in self.running if s.request_id == request_id] + self._drop_waiting(request_id)
        self.running = [s for s in self.running if s.request_id != request_id]
        for seq in dropped:
            self.kv.free(seq)
            seq.finish(seq.finish_reason or "abort")
        return dropped

    @property
    def num_running(self) -> int:
        return len(self.running)
