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

Trees (``DraftProposal.parents``, ``spec_tree``): a drafter with ``drafts_trees`` may propose
a tree of candidates for a greedy request. Its nodes are appended in node order like a
chain's drafts (so the token budget and ``drop_unscheduled`` work unchanged: keeping the
first nodes of a topological order keeps a subtree) and the parents ride on the sequence
(``seq.draft_parents``) to the runner, which gives the step tree positions and a tree mask.
``verify`` walks the tree (greedy) and moves the accepted path's K/V to the positions a
chain would have used before ``rollback``. A sampling request gets only the chain of first
children, which the existing speculative-sampling verifier keeps exact. Stats: a tree
counts its nodes as drafted and its accepted path length as accepted, so the acceptance
rate falls with the tree's size; tokens per target forward is the figure that matters.
"""

from __future__ import annotations

import torch

from lmplug.engine.sequence import Sequence
from lmplug.engine.spec_tree import depths, first_child_chain, is_chain, move_kv, subtree
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
            tokens, probs, parents = list(proposal.token_ids[i]), proposal.probs_of(i), proposal.parents_of(i)
            if parents is not None:
                tokens, probs, parents = self._fit_tree(seq, tokens, probs, parents)
            if parents is None:
                tokens = tokens[:room[seq.seq_id]]
            if not tokens:
                continue
            self._probs[seq.seq_id] = None if probs is None else probs[:len(tokens)]
            seq.token_ids.extend(tokens)
            seq.num_draft_tokens = len(tokens)
            seq.draft_parents = parents

    def _fit_tree(self, seq: Sequence, tokens: list[int], probs: torch.Tensor | None,
                  parents: list[int]) -> tuple[list[int], torch.Tensor | None, list[int] | None]:
        """A proposed tree, cut to what this sequence may verify: for a sampling request the chain
        of first children (returned with parents None); for a greedy one the nodes that fit the
        context (node j's K/V sits at position start + j) and whose depth fits max_tokens."""
        if not self.drafter.drafts_trees:
            raise RuntimeError(f"speculative: drafter {self.drafter.name!r} proposed a tree but its "
                               "drafts_trees is False (only tree-aware drafters, e.g. medusa with "
                               "`tree`, may propose trees)")
        if len(parents) != len(tokens):
            raise RuntimeError(f"speculative: drafter {self.drafter.name!r} proposed {len(tokens)} "
                               f"tokens with {len(parents)} parents")
        if not seq.params.is_greedy:
            keep = first_child_chain(parents)
            return [tokens[j] for j in keep], None if probs is None else probs[keep], None
        nodes_room = self.max_model_len - seq.num_tokens - 1
        depth_room = nodes_room
        if seq.params.max_tokens is not None:
            depth_room = min(depth_room, seq.params.max_tokens - seq.num_output_tokens - 1)
        depth = depths(parents)
        keep = [j for j in range(min(len(tokens), nodes_room)) if depth[j] <= depth_room]
        if len(keep) < len(tokens):
            parents = subtree(parents, keep)
            tokens = [tokens[j] for j in keep]
            probs = None if probs is None else probs[keep]
        return tokens, probs, None if is_chain(parents) else parents

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
                parents = seq.draft_parents  # a topological order's head is a subtree
                seq.draft_parents = None if parents is None or is_chain(parents[:keep]) else parents[:keep]
                probs = self._probs.get(seq.seq_id)
                self._probs[seq.seq_id] = None if probs is None else probs[:keep]

    # -- after the forward -----------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """Strip every sequence's drafts and decide what it emits.

        Returns, per sequence, the tokens to append and the logits row of each (for logprobs).
        ``hidden`` (the target's final hidden states behind ``logits``) is kept for ``observe``.
        """
        drafts, trees = [], []
        for seq in seqs:
            n = seq.num_draft_tokens
            drafts.append(seq.token_ids[seq.num_tokens - n:] if n else [])
            del seq.token_ids[seq.num_tokens - n:]
            seq.num_draft_tokens = 0
            trees.append(seq.draft_parents if n else None)
            seq.draft_parents = None
        verdicts = verify_batch(logits, num_rows, [s.params for s in seqs], drafts,
                                [self._probs.pop(s.seq_id, None) for s in seqs],
                                [s.generator for s in seqs], trees)
        emitted, rows, start = [], [], 0
        for seq, draft, verdict, n in zip(seqs, drafts, verdicts, num_rows):
            self._count(seq, len(draft), verdict.num_accepted)
            emitted.append(verdict.tokens)
            rows.append([start + r for r in verdict.rows])
            if verdict.nodes:  # a tree: the accepted path's K/V to the positions a chain has
                root = seq.num_tokens - 1
                src = [root + 1 + j for j in verdict.nodes]
                dst = [root + 1 + d for d in range(len(verdict.nodes))]
                move_kv(self.kv, seq, src, dst)
                if self.drafter is not None:  # (tests verify trees without one)
                    self.drafter.kv_moved(seq, src, dst)
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
