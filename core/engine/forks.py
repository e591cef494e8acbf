"""``n > 1`` forks: the one party that decides whether a request's samples share its prompt's KV,
holds the siblings back, forks them from the first sequence at its first token and hands them to
the scheduler.

Forking needs a KV cache and a scheduler that both declare "fork", one process (a fork's
copy-on-write block copies happen in rank 0's pool only) and no state layers (a fork takes a state
slot at once, and forks can outnumber max_num_seqs, the slots the pool has). Without it, each
sample runs as its own sequence from the start.
"""

from __future__ import annotations

import itertools

import torch

from lmplug.interfaces.sequence import Sequence


class Forks:
    def __init__(self, kv, scheduler, *, parallel: bool) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.enabled = (not parallel and "fork" in kv.capabilities.features
                        and "fork" in scheduler.capabilities.features and not kv.spec.states)
        self._pending: dict[str, list[Sequence]] = {}  # request id -> siblings waiting for seqs[0]

    def hold(self, request_id: str, seqs: list[Sequence]) -> list[Sequence]:
        """A new request's sequences; returns those to schedule now (with forking, the first only)."""
        if not self.enabled:
            return seqs
        if len(seqs) > 1:
            self._pending[request_id] = seqs[1:]
        return seqs[:1]

    def drop(self, request_id: str) -> None:
        """The request ended (aborted, failed): its waiting siblings are never forked."""
        self._pending.pop(request_id, None)

    def fork(self, seqs: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor | None,
             num_rows: list[int]) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None,
                                           list[int], list[Sequence]]:
        """Fork the waiting siblings of every sequence about to sample its first token.

        A child shares its parent's prompt KV (``kv.fork``) and samples its own first token,
        with its own generator, from a copy of the parent's (last) logits (and hidden) row.
        Returns the sequences with the children appended, the rows to match, and the children.
        """
        if not self._pending:
            return seqs, logits, hidden, num_rows, []
        last_rows = [end - 1 for end in itertools.accumulate(num_rows)]  # no tensor ops: runs every step
        rows, forked = [], []
        for i, parent in enumerate(seqs):
            for child in self._pending.pop(parent.request_id, []):
                child.fork_from(parent)
                self.kv.fork(parent, child)
                rows.append(last_rows[i])
                forked.append(child)
        if not forked:
            return seqs, logits, hidden, num_rows, []
        logits = torch.cat([logits, logits[rows]])
        hidden = None if hidden is None else torch.cat([hidden, hidden[rows]])
        return seqs + forked, logits, hidden, num_rows + [1] * len(forked), forked

    def place(self, forked: list[Sequence]) -> None:
        """After the step's commit: a child that already finished frees its blocks (it never
        reached the scheduler, which would free them), the others run from the next step."""
        for seq in forked:
            if seq.is_finished:
                self.kv.free(seq)
            else:
                self.scheduler.add_running(seq)
