"""The speculator: the engine's select stage when a drafter is configured.

One step with a drafter (the engine calls the stage at each point):

1. ``propose`` (before scheduling): the drafter proposes up to ``k`` tokens for each running
   decode sequence (with ``draft_length``, ``draft_length.py``: as many as pay for their
   drafting and verifying, none when none would; then each chain is cut to what pays to
   verify). They stay here; the scheduler learns only how many tokens past
   ``token_ids`` each sequence may compute (its *lookahead*) and counts them against its
   token budget and the KV cache like any others.
2. ``plan`` (after scheduling): the drafts the scheduler fit (``num_new_tokens - 1``; none for
   a sequence left out or preempted) are appended to ``seq.token_ids`` for the forward, and
   the scheduled row says how many logits rows the step needs back and, for a tree, its
   positions and attention mask. The rest are dropped.
3. ``select`` (after the forward): strip the drafts, verify them against the logits and
   return what to emit: accepted drafts plus one target token. The engine appends them one by
   one, checking stop conditions on each.
4. ``settle`` (after appending): ``num_computed_tokens`` falls back to the accepted length
   (the K/V of rejected drafts is stale) and the KV backend releases what lies past it;
   finished sequences are released; hidden-state drafters observe the target's states.

Trees (``DraftProposal.parents``, ``tree``): a drafter with ``drafts_trees`` may propose a
tree of candidates for a greedy request. Its nodes are appended in node order like a chain's
drafts (so the token budget and cutting work unchanged: keeping the first nodes of a
topological order keeps a subtree) and the runner gets tree positions and an ancestor mask.
``select`` walks the tree (greedy) and moves the accepted path's K/V to the positions a chain
would have used before the rollback. A sampling request gets only the chain of first children,
which the speculative-sampling verifier keeps exact. Stats: a tree counts its nodes as drafted
and its accepted path length as accepted, so the acceptance rate falls with the tree's size;
tokens per target forward is the figure that matters.

Acceptance (``rule``, an ``AcceptanceRule`` from ``speculative.acceptance``; None: exact
speculative sampling): the verifier hands it each chain's shaped target and draft
distributions. ``admit`` refuses a request asking for exact sampling under a lossy rule;
``rule_name`` / ``lossy`` are what the engine reports in each request's metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmplug.constraints import Constraints
from lmplug.interfaces.acceptance import AcceptanceRule, check_exact_request
from lmplug.interfaces.drafter import Drafter
from lmplug.interfaces.kvcache import KVCacheBackend
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq, samples_now
from lmplug.interfaces.sequence import Sequence, SequenceStatus
from lmplug.kit.draft_tree import depths, is_chain, tree_rows
from lmplug.kit.penalties import NO_HISTORY, PromptIds
from lmplug.speculative.draft_length import DraftLength
from lmplug.speculative.tree import first_child_chain, head, move_kv, subtree
from lmplug.speculative.verifier import verify_batch


@dataclass
class Draft:
    """One sequence's proposal: tokens, their draft distributions (None: point masses) and,
    for a tree, each node's parent (None: a chain)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None

    def head(self, keep: int) -> Draft:
        return Draft(self.tokens[:keep], None if self.probs is None else self.probs[:keep],
                     head(self.parents, keep))


class Speculator:
    def __init__(self, drafter: Drafter, num_tokens: int, kv: KVCacheBackend, max_model_len: int,
                 constraints: Constraints | None = None, eos_token_ids: frozenset[int] = frozenset(),
                 rule: AcceptanceRule | None = None, draft_length: DraftLength | None = None) -> None:
        self.drafter = drafter
        self.draft_length = draft_length  # None: verify every proposed draft
        self._forward: tuple[int, float] | None = None  # this step's rows and the forward's start
        self.rule = rule
        self.constraints = constraints or Constraints(None, 0)
        self.eos_token_ids = eos_token_ids
        self._masks = None  # this step's mask job (structured output), started in plan
        self.num_tokens = num_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self._proposed: dict[int, Draft] = {}  # seq_id -> drafts awaiting scheduling
        self._planned: dict[int, Draft] = {}  # seq_id -> drafts in this step's forward
        self.num_drafted = 0  # totals over the engine's life
        self.num_accepted = 0
        self.num_verified = 0  # sequence-steps that verified at least one draft
        self._step = {"drafted": 0, "accepted": 0}
        self._hidden: torch.Tensor | None = None  # [B, h] of the last verify, for observe
        self._prompts = PromptIds()  # each penalised sequence's prompt, for its rows' histories

    @property
    def rule_name(self) -> str:
        return "exact" if self.rule is None else self.rule.name

    @property
    def lossy(self) -> bool:
        return self.rule is not None and self.rule.lossy

    def claims(self, params: SamplingParams) -> bool:
        return True

    def admit(self, params: SamplingParams) -> None:
        """Refuse (``ConfigError``) a request that asks for exact sampling under a lossy rule."""
        check_exact_request(params, self.rule)

    # -- before scheduling -----------------------------------------------------------------------
    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        """Draft for the decode sequences among ``seqs`` that have room; returns each drafted
        sequence's lookahead (seq_id -> draft tokens) for the scheduler."""
        seqs = [s for s in seqs if s.status is SequenceStatus.RUNNING and not s.is_prefill
                and s.num_computed_tokens == s.num_tokens - 1]
        room = {s.seq_id: self._room(s) for s in seqs}
        seqs = [s for s in seqs if room[s.seq_id] > 0]
        self._step = {"drafted": 0, "accepted": 0}
        self._proposed = {}
        if not seqs:
            return {}
        ask = self._tokens_to_ask(seqs, room)
        if ask == 0:  # no sequence's drafts would pay for their drafting and verifying: decode plainly
            return {}
        start = time.perf_counter()
        proposal = self.drafter.propose(seqs, ask)
        if self.draft_length is not None:
            self.draft_length.observe_draft(ask, time.perf_counter() - start)
        other_rows = len(seqs) - 1  # the step's rows besides a sequence's own (draft_length)
        for i, seq in enumerate(seqs):
            tokens, probs, parents = list(proposal.token_ids[i]), proposal.probs_of(i), proposal.parents_of(i)
            if parents is not None:
                tokens, probs, parents = self._fit_tree(seq, tokens, probs, parents)
            if parents is None:
                tokens = tokens[:room[seq.seq_id]]
                if self._may_cut(seq):
                    tokens = tokens[:self.draft_length.choose(seq.seq_id, len(tokens), other_rows)]
                other_rows += len(tokens)
            if tokens:
                self._proposed[seq.seq_id] = Draft(tokens, None if probs is None else probs[:len(tokens)],
                                                   parents)
        return {seq_id: len(d.tokens) for seq_id, d in self._proposed.items()}

    def _may_cut(self, seq: Sequence) -> bool:
        """``draft_length`` chooses this sequence's drafts: not for a seeded sampling request,
        which keeps every draft (its random draws, one per judged draft, then follow the drafter
        alone, so the seed gives the same text whatever the forwards cost)."""
        return self.draft_length is not None and (seq.params.is_greedy or seq.params.seed is None)

    def _tokens_to_ask(self, seqs: list[Sequence], room: dict[int, int]) -> int:
        """How many tokens a sequence the drafter is asked for: ``num_tokens``, or with
        ``draft_length`` the most any sequence would verify, its drafting time counted (tree
        drafters and sequences that keep every draft ask for all)."""
        if self.draft_length is None or self.drafter.drafts_trees:
            return self.num_tokens
        others = len(seqs) - 1
        return max(self.draft_length.choose(s.seq_id, room[s.seq_id], others, drafting=True) if self._may_cut(s)
                   else room[s.seq_id] for s in seqs)

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
        if not seq.params.is_greedy or seq.params.structured is not None or seq.params.needs_adjusting:
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

    # -- after scheduling ------------------------------------------------------------------------
    def plan(self, scheduled: list[ScheduledSeq]) -> None:
        """Put the drafts the scheduler fit (``num_new_tokens - 1`` of them) into the forward;
        drop the others (a sequence left out or preempted drafts afresh next step)."""
        proposed, self._proposed = self._proposed, {}
        for item in scheduled:
            draft = proposed.get(item.seq.seq_id)
            keep = 0 if draft is None else min(len(draft.tokens), item.num_new_tokens - 1)
            if keep > 0:
                self.add_draft(item, draft.head(keep))
        # a step of decode and verify rows only is timed for draft_length (a prefill's rows cost otherwise)
        self._forward = None
        if self.draft_length is not None and scheduled and all(
                item.num_new_tokens == item.num_logit_rows for item in scheduled):
            self._forward = (sum(item.num_new_tokens for item in scheduled), time.perf_counter())
        sampling = [item.seq for item in scheduled if samples_now(item)]
        self._masks = self.constraints.start(
            sampling, [self._planned[s.seq_id].tokens if s.seq_id in self._planned else [] for s in sampling])

    def add_draft(self, item: ScheduledSeq, draft: Draft) -> None:
        """Append ``draft`` to the scheduled sequence and describe its rows to the runner."""
        seq = item.seq
        start = seq.num_computed_tokens
        seq.extend_tokens(draft.tokens)
        self._planned[seq.seq_id] = draft
        item.num_logit_rows = 1 + len(draft.tokens)
        if draft.parents is not None:
            item.positions, item.mask = tree_rows(start, draft.parents)

    # -- after the forward -----------------------------------------------------------------------
    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]:
        if self._forward is not None:
            rows, start = self._forward
            self.draft_length.observe_forward(rows, time.perf_counter() - start)
            self._forward = None
        return self.verify(logits, num_rows, seqs, hidden, on_error)

    def verify(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]:
        """Strip every sequence's drafts and decide what it emits.

        Returns, per sequence, the tokens to append and the logits row of each (for logprobs).
        ``hidden`` (the target's final hidden states behind ``logits``) is kept for ``observe``.
        With ``on_error``, a sequence whose verification raises gets nothing and goes there.
        """
        # the masks were filled with the drafts in place: wait for them before the drafts go
        filled, self._masks = self.constraints.result(self._masks), None
        drafts = [self._planned.pop(s.seq_id, None) or Draft([]) for s in seqs]
        for seq, draft in zip(seqs, drafts):
            if draft.tokens:
                seq.truncate_tokens(seq.num_tokens - len(draft.tokens))
        verdicts = self._verdicts(logits, num_rows, seqs, drafts, filled, on_error)
        emitted, rows, last, start = [], [], [], 0
        for seq, draft, verdict, n in zip(seqs, drafts, verdicts, num_rows):
            last.append(start + (verdict.rows[-1] if verdict else 0))
            emitted.append(verdict.tokens if verdict else [])
            rows.append([start + r for r in verdict.rows] if verdict else [])
            if verdict:
                self._count(seq, len(draft.tokens), verdict.num_accepted)
                if self.draft_length is not None and draft.parents is None:
                    self.draft_length.observe_verify(seq.seq_id, len(draft.tokens), verdict.num_accepted)
                if verdict.nodes:
                    self._move_accepted_path(seq, verdict.nodes)
            start += n
        if hidden is not None:  # the row whose logits chose each sequence's last emitted token
            self._hidden = hidden[last]
        return emitted, rows

    def _verdicts(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence], drafts: list[Draft],
                  filled: dict, on_error) -> list:
        """``verify_batch`` over all sequences; if it raises and ``on_error`` is given, one
        sequence at a time (None for those that raise). Each row is shaped as the plain sampler
        shapes it (penalties over the tokens before it, drafts included; the constraint's mask
        after the drafts before it), so the verified distribution is the one sampling would use."""
        columns = ([s.params for s in seqs], [d.tokens for d in drafts], [d.probs for d in drafts],
                   [s.generator for s in seqs], [d.parents for d in drafts])
        try:
            return verify_batch(logits, num_rows, *columns, **self._shaping(seqs, num_rows, drafts, filled),
                                rule=self.rule)
        except Exception:
            if on_error is None:
                raise
        out, start = [], 0
        for i, (seq, n) in enumerate(zip(seqs, num_rows)):
            try:
                shaping = self._shaping([seq], [n], [drafts[i]], filled)
                out.append(verify_batch(logits[start:start + n], [n], *[[c[i]] for c in columns], **shaping,
                                        rule=self.rule)[0])
            except Exception as exc:  # noqa: BLE001  (reported to on_error, which logs it)
                on_error(seq, exc)
                out.append(None)
            start += n
        return out

    def _shaping(self, seqs: list[Sequence], num_rows: list[int], drafts: list[Draft], filled: dict) -> dict:
        """``verify_batch``'s keyword arguments for penalties and masks (none when no row needs them)."""
        masks = self.constraints.assemble(seqs, num_rows, filled)
        histories = None
        if any(s.params.needs_adjusting for s in seqs):
            histories = []
            for seq, draft, n in zip(seqs, drafts, num_rows):
                if not seq.params.needs_adjusting:
                    histories += [NO_HISTORY] * n
                    continue
                output = seq.output_token_ids
                histories += [self._prompts.history(seq, output + draft.tokens[:j]) for j in range(n)]
        return {"histories": histories, "eos_token_ids": self.eos_token_ids,
                "bitmask": masks.bitmask, "bitmask_rows": masks.rows}

    def _move_accepted_path(self, seq: Sequence, nodes: list[int]) -> None:
        """A tree's accepted nodes sit at start + j; move their K/V to the positions a chain has."""
        root = seq.num_tokens - 1
        src = [root + 1 + j for j in nodes]
        dst = [root + 1 + d for d in range(len(nodes))]
        move_kv(self.kv, seq, src, dst)
        if self.drafter is not None:  # (tests verify trees without one)
            self.drafter.kv_moved(seq, src, dst)

    def settle(self, seqs: list[Sequence]) -> None:
        """After the emitted tokens are appended: roll back, release the finished, observe."""
        for seq in seqs:
            self.rollback(seq)
            if seq.is_finished:
                self.release(seq)
        self.observe(seqs)

    def observe(self, seqs: list[Sequence]) -> None:
        """Hand hidden-state drafters the target's hidden state at each sequence's last
        computed position (it predicted the last token)."""
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
        """K/V is valid only up to the accepted tokens (the last token, just emitted, is
        computed next step)."""
        valid = seq.num_tokens - 1
        if seq.num_computed_tokens > valid:
            seq.rewind(valid)
            self.kv.truncate(seq, valid)

    def release(self, seq: Sequence) -> None:
        self.constraints.release(seq)
        self._prompts.release(seq)
        self._proposed.pop(seq.seq_id, None)
        self._planned.pop(seq.seq_id, None)
        if self.draft_length is not None:
            self.draft_length.release(seq.seq_id)
        self.drafter.release(seq)

    # -- statistics ------------------------------------------------------------------------------
    def annotate(self, outputs: list) -> None:
        """Which acceptance rule decided each request's tokens, and whether it is exact."""
        for out in outputs:
            if out.metrics is not None:
                out.metrics.acceptance_rule, out.metrics.lossy = self.rule_name, self.lossy

    def stats(self) -> dict:
        """This step's counts and the running acceptance rate / mean accepted length."""
        return {
            "spec_num_drafted": self._step["drafted"], "spec_num_accepted": self._step["accepted"],
            "spec_acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
            "spec_mean_accepted": self.num_accepted / self.num_verified if self.num_verified else 0.0,
        }
