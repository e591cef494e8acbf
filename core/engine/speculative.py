"""Speculative decoding in the engine: propose -> schedule -> verify -> roll back.

One step with a drafter:

1. ``propose``: the drafter proposes up to ``k`` tokens for each running decode sequence;
   they are appended to ``seq.token_ids`` tentatively (``seq.num_draft_tokens``), so the
   scheduler sees ``1 + k`` uncomputed tokens and counts them against its token budget.
2. ``drop_unscheduled``: drafts the scheduler did not fit (a partial chunk, a sequence
   left out or preempted) are removed before the forward.
3. the runner returns logits for the last accepted token and every draft position;
   ``verify`` strips the drafts and returns what to emit: accepted drafts plus one target
   token. The engine appends them one by one, checking stop conditions on each.
4. ``rollback``: ``num_computed_tokens`` falls back to the accepted length (the K/V of
   rejected drafts is stale) and the KV backend releases what lies past it.
"""

from __future__ import annotations

import torch

from lmplug.engine.sequence import Sequence
from lmplug.engine.verifier import verify_batch
from lmplug.interfaces.drafter import Drafter
from lmplug.interfaces.kvcache import KVCacheBackend
from lmplug.interfaces.scheduler import ScheduledSeq


class Speculator:
    def __init__(self, drafter: Drafter, num_tokens: int, kv: KVCacheBackend, max_model_len: int) -> None:
        self.drafter = drafter
        self.num_tokens = num_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self._probs: dict[int, torch.Tensor | None] = {}  # seq_id -> draft distributions [n, V]
        self.num_drafted = 0  # totals over the engine's life
        self.num_accepted = 0
        self.num_verified = 0  # sequence-steps that verified at least one draft
        self._step = {"drafted": 0, "accepted": 0}
        self._hidden: torch.Tensor | None = None  # [B, h] of the last verify, for observe

    # -- before scheduling -----------------------------------------------------------------------
    def propose(self, seqs: list[Sequence]) -> None:
        """Append drafts to each decode sequence in ``seqs`` that has room for them."""
        room = {s.seq_id: self._room(s) for s in seqs}
        seqs = [s for s in seqs if room[s.seq_id] > 0]
        self._step = {"drafted": 0, "accepted": 0}
        if not seqs:
            return
        proposal = self.drafter.propose(seqs, self.num_tokens)
        for i, seq in enumerate(seqs):
            tokens = list(proposal.token_ids[i])[:room[seq.seq_id]]
            if not tokens:
                continue
            probs = proposal.probs_of(i)
            self._probs[seq.seq_id] = None if probs is None else probs[:len(tokens)]
            seq.token_ids.extend(tokens)
            seq.num_draft_tokens = len(tokens)

    def _room(self, seq: Sequence) -> int:
        """How many drafts are worth verifying: a step emits at most drafts + 1 tokens, and
        must stay within max_tokens and the context limit."""
        left = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(self.num_tokens, left - 1))

    def drop_unscheduled(self, scheduled: list[ScheduledSeq], drafted: list[Sequence]) -> None:
        """Keep only the drafts this step computes: ``num_new_tokens - 1`` of them."""
        num_new = {item.seq.seq_id: item.num_new_tokens for item in scheduled}
        for seq in drafted:
            if seq.num_draft_tokens == 0:
                continue
            keep = min(seq.num_draft_tokens, max(0, num_new.get(seq.seq_id, 0) - 1))
            if keep < seq.num_draft_tokens:
                del seq.token_ids[seq.num_tokens - seq.num_draft_tokens + keep:]
                seq.num_draft_tokens = keep
                probs = self._probs.get(seq.seq_id)
                self._probs[seq.seq_id] = None if probs is None else probs[:keep]

    # -- after the forward -----------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """Strip every sequence's drafts and decide what it emits.

        Returns, per sequence, the tokens to append and the logits row of each (for logprobs).
        ``hidden`` (the target's final hidden states behind ``logits``) is kept for ``observe``.
        """
        drafts = []
        for seq in seqs:
            n = seq.num_draft_tokens
            drafts.append(seq.token_ids[seq.num_tokens - n:] if n else [])
            del seq.token_ids[seq.num_tokens - n:]
            seq.num_draft_tokens = 0
        verdicts = verify_batch(logits, num_rows, [s.params for s in seqs], drafts,
                                [self._probs.pop(s.seq_id, None) for s in seqs],
                                [s.generator for s in seqs])
        emitted, rows, start = [], [], 0
        for seq, draft, verdict, n in zip(seqs, drafts, verdicts, num_rows):
            self._count(seq, len(draft), verdict.num_accepted)
            emitted.append(verdict.tokens)
            rows.append(list(range(start, start + len(verdict.tokens))))
            start += n
        if hidden is not None:  # the row whose logits chose each sequence's last emitted token
            self._hidden = hidden[[r[-1] for r in rows]]
        return emitted, rows

    def observe(self, seqs: list[Sequence]) -> None:
        """After the emitted tokens are appended: hand hidden-state drafters the target's hidden
        state at each sequence's last computed position (it predicted the last token)."""
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            return
        live = [i for i, s in enumerate(seqs) if not s.is_finished]
        if live:
            self.drafter.observe([seqs[i] for i in live], hidden[live])

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        seq.num_drafted += drafted
        seq.num_accepted += accepted
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_verified += 1
        self._step["drafted"] += drafted
        self._step["accepted"] += accepted

    def rollback(self, seq: Sequence) -> None:
        """After the emitted tokens are appended: K/V is valid only up to the accepted tokens
        (the last token, just emitted, is computed next step)."""
        valid = seq.num_tokens - 1
        if seq.num_computed_tokens > valid:
            seq.num_computed_tokens = valid
            self.kv.truncate(seq, valid)

    def release(self, seq: Sequence) -> None:
        self._probs.pop(seq.seq_id, None)
        self.drafter.release(seq)

    # -- statistics ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """This step's counts and the running acceptance rate / mean accepted length."""
        return {
            "spec_num_drafted": self._step["drafted"], "spec_num_accepted": self._step["accepted"],
            "spec_acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
            "spec_mean_accepted": self.num_accepted / self.num_verified if self.num_verified else 0.0,
        }
