"""``DrafterConformance``: a drafter's proposals are well-formed, deterministic and survive rejection.

Checks: one proposal per sequence, at most ``k`` tokens, ids inside the
vocabulary, draft distributions (when given) shaped ``[len, vocab]`` and
summing to 1; the same input gives the same proposal (from the same object,
a fresh one, and inside a larger batch); and a greedy speculative loop with
the suite's fake target model — accept the longest prefix the target agrees
with, then one target token — yields exactly the target's own greedy output,
so a drafter that keeps state across steps must follow rejected tokens.

Not yet checked: that sampling through the core's exact rejection-sampling
verifier keeps the target distribution. That verifier arrives with the
speculative-decoding issue; this suite uses its own greedy accept rule.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from lmplug.api import Drafter, DraftProposal
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence, SequenceStatus
from lmplug.testing.base import Conformance
from lmplug.testing.compare import ContractViolation, fail, reported

DEFAULT_PROMPTS = (
    (5, 6, 7, 8, 5, 6, 7, 8, 5, 6),  # repeats: n-gram drafters find matches
    (1, 2, 3, 1, 2, 3, 1, 2),
    (9,),
    (4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4),
    tuple(range(10, 50)),
)


def target_next(tokens: list[int], vocab_size: int) -> int:
    """The fake target model's greedy choice: periodic, so drafters that find patterns do well."""
    return (
        tokens[-3] if len(tokens) >= 3 and len(tokens) % 5 else (sum(tokens) * 7 + 3) % vocab_size
    )


class DrafterConformance(Conformance):
    family = "speculative"
    vocab_size: ClassVar[int] = 64
    num_speculative_tokens: ClassVar[list[int]] = [1, 3, 5]
    prompts: ClassVar[tuple[tuple[int, ...], ...]] = DEFAULT_PROMPTS
    batch_invariant: ClassVar[bool] = (
        True  # proposals do not depend on the other sequences in the batch
    )
    # mid-decode proposals equal a fresh drafter's on the same tokens (False: a draft model whose
    # cached state may differ in the last bits from a recomputation)
    fresh_equivalent: ClassVar[bool] = True
    decode_steps: ClassVar[int] = 24

    def make_drafter(self, backend_class: type, options) -> Drafter:
        """Override when the drafter needs more than its options (e.g. a draft model)."""
        return backend_class(options)

    def params_k(self) -> list:
        return [pytest.param(k, id=f"k{k}") for k in self.num_speculative_tokens]

    def sequences(self) -> list[Sequence]:
        out = []
        for i, prompt in enumerate(self.prompts):
            seq = Sequence(
                f"req-{i}", [t % self.vocab_size for t in prompt], SamplingParams(temperature=0)
            )
            seq.start_running()
            seq.rewind(seq.num_tokens - 1)  # as after a step: the last token is not yet computed
            out.append(seq)
        return out

    # -- tests -------------------------------------------------------------------------------------
    def test_proposals_well_formed(self, backend_class, backend_options, k: int) -> None:
        seqs = self.sequences()
        with reported(self.label()):
            proposal = self.make_drafter(backend_class, backend_options).propose(seqs, k)
            check_proposal(proposal, seqs, k, self.vocab_size, f"{self.label()}, k={k}")

    def test_deterministic(self, backend_class, backend_options, k: int) -> None:
        seqs = self.sequences()
        with reported(self.label()):
            drafter = self.make_drafter(backend_class, backend_options)
            first = drafter.propose(seqs, k).token_ids
            again = drafter.propose(seqs, k).token_ids
            fresh = (
                self.make_drafter(backend_class, backend_options)
                .propose(self.sequences(), k)
                .token_ids
            )
        for what, other in (("a second call", again), ("a fresh drafter", fresh)):
            if other != first:
                fail(
                    f"{self.label()}, k={k}: proposals for the same sequences differ: {first} then "
                    f"{other} from {what}"
                )
        if self.batch_invariant:
            for i, seq in enumerate(self.sequences()):
                with reported(self.label()):
                    alone = (
                        self.make_drafter(backend_class, backend_options)
                        .propose([seq], k)
                        .token_ids
                    )
                if alone != [first[i]]:
                    fail(
                        f"{self.label()}, k={k}: sequence {i} alone gets {alone[0]}, in the batch "
                        f"{first[i]} (set batch_invariant = False if that is intended)"
                    )

    def test_greedy_speculation_equals_target(self, backend_class, backend_options, k: int) -> None:
        """Accept the longest prefix the target agrees with, plus one target token; repeat."""
        seqs = self.sequences()
        with reported(self.label()):
            drafter = self.make_drafter(backend_class, backend_options)
            expected = [self._target_greedy(list(s.token_ids)) for s in seqs]
            for _ in range(self.decode_steps):
                proposal = drafter.propose(seqs, k)
                check_proposal(
                    proposal, seqs, k, self.vocab_size, f"{self.label()}, k={k}, mid-decode"
                )
                if self.fresh_equivalent:
                    self._same_as_fresh(backend_class, backend_options, seqs, k, proposal)
                for seq, draft in zip(seqs, proposal.token_ids):
                    accept_greedy(seq, draft, self.vocab_size)
        for i, (seq, want) in enumerate(zip(seqs, expected)):
            got = seq.output_token_ids[: self.decode_steps]
            if got != want:
                fail(
                    f"{self.label()}, k={k}: sequence {i} decoded {got} with speculation, the target "
                    f"alone {want}"
                )

    def _same_as_fresh(
        self, backend_class, options, seqs: list[Sequence], k: int, proposal
    ) -> None:
        copies = []
        for seq in seqs:
            copy = Sequence(seq.request_id, seq.prompt_token_ids, seq.params)
            copy.reset_tokens(seq.token_ids, seq.num_computed_tokens)
            if seq.status is SequenceStatus.RUNNING:  # (a fresh one waits; finished ones draft nothing)
                copy.start_running()
            copies.append(copy)
        fresh = self.make_drafter(backend_class, options).propose(copies, k).token_ids
        if fresh != proposal.token_ids:
            i = next(i for i, (a, b) in enumerate(zip(fresh, proposal.token_ids)) if a != b)
            raise ContractViolation(
                f"{self.label()}, k={k}: after {seqs[i].num_output_tokens} decoded tokens, "
                f"sequence {i} gets {proposal.token_ids[i]} but a fresh drafter proposes "
                f"{fresh[i]} for the same tokens: state kept across steps went stale "
                f"(set fresh_equivalent = False if small numeric drift is expected)"
            )

    def _target_greedy(self, tokens: list[int]) -> list[int]:
        start = len(tokens)
        while len(tokens) - start < self.decode_steps:
            tokens.append(target_next(tokens, self.vocab_size))
        return tokens[start:]


def accept_greedy(seq: Sequence, draft: list[int], vocab_size: int) -> int:
    """Append the accepted draft tokens and the target's next one; returns how many were drafted ok."""
    accepted = 0
    for token in draft:
        if token != target_next(seq.token_ids, vocab_size):
            break
        seq.append_token(token)
        accepted += 1
    seq.append_token(target_next(seq.token_ids, vocab_size))
    seq.rewind(seq.num_tokens - 1)
    return accepted


def check_proposal(
    proposal: DraftProposal, seqs: list[Sequence], k: int, vocab: int, where: str
) -> None:
    if not isinstance(proposal, DraftProposal):
        raise ContractViolation(
            f"{where}: propose() returned {type(proposal).__name__}, not a DraftProposal"
        )
    ids = proposal.token_ids
    if not isinstance(ids, list) or len(ids) != len(seqs):
        raise ContractViolation(
            f"{where}: {len(seqs)} sequences but token_ids has "
            f"{len(ids) if isinstance(ids, list) else type(ids).__name__} entries"
        )
    for i, tokens in enumerate(ids):
        if len(tokens) > k:
            raise ContractViolation(
                f"{where}: sequence {i} got {len(tokens)} proposals, more than k={k}"
            )
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ContractViolation(
                f"{where}: sequence {i} proposals {bad} are not token ids in [0, {vocab})"
            )
    if proposal.probs is not None:
        _check_probs(proposal, vocab, where)


def _check_probs(proposal: DraftProposal, vocab: int, where: str) -> None:
    for i, (tokens, probs) in enumerate(zip(proposal.token_ids, proposal.probs)):
        if probs is None:  # greedy sequences need no draft distribution
            continue
        if tuple(probs.shape) != (len(tokens), vocab):
            raise ContractViolation(
                f"{where}: sequence {i} probs shape {tuple(probs.shape)}, expected "
                f"({len(tokens)}, {vocab})"
            )
        sums = probs.double().sum(dim=-1)
        if (probs < 0).any() or not torch.allclose(sums, torch.ones_like(sums), atol=1e-3):
            raise ContractViolation(
                f"{where}: sequence {i} probs are not distributions (row sums {sums.tolist()})"
            )
        chosen = probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
        if (chosen <= 0).any():
            raise ContractViolation(
                f"{where}: sequence {i} proposes tokens its own distribution gives probability 0"
            )
