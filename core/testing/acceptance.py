"""``AcceptanceConformance``: what every speculative acceptance rule must hold to.

On seeded random target / draft distributions (small vocabularies, chains of 0..4 drafts):

- a verdict is well formed: 1..k+1 tokens, all in the vocabulary, the accepted ones equal to the
  draft's prefix, for drafted (``q`` given) and deterministic (``q`` None) chains, greedy too;
- the same generator seed gives the same verdicts (on one instance and on a fresh one);
- the first emitted token follows the law the rule declares (``emitted_distribution``), by
  chi-square over many draws, with and without a draft distribution;
- the rule never emits a token the target rules out (p = 0: masks, filters);
- ``lossy`` and the "lossy" capabilities feature agree; a rule with ``lossy = False`` declares
  p as its law and its tokens follow p (chi-square against p itself, not against its claim),
  and its greedy verdict is the longest prefix equal to the argmax.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from lmplug.interfaces.acceptance import LOSSY, AcceptanceRule, Decision, greedy_prefix
from lmplug.kit.sampling import draw
from lmplug.testing.base import Conformance
from lmplug.testing.compare import fail

ALPHA = 1e-3  # a correct rule fails a chi-square check once in a thousand seeds; these seeds are fixed
VOCAB = 6


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of ``counts`` to ``probs`` (categories with p > 0)."""
    probs = probs.double() / probs.double().sum()
    keep = probs > 0
    if (counts[~keep] > 0).any():
        return 0.0  # a sample the distribution cannot produce
    n = counts.double().sum()
    expected = probs[keep] * n
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def random_chain(k: int, seed: int, zeros: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """p [k+1, V] and q [k, V]: softmaxes of correlated random logits (q near p, so rules accept
    sometimes and reject sometimes); ``zeros``: p rules out two tokens per row, as a mask would."""
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(k + 1, VOCAB, generator=g, dtype=torch.float64)
    q = (logits[:k] + torch.randn(k, VOCAB, generator=g, dtype=torch.float64)).softmax(-1)
    if zeros:
        logits[:, :2] = float("-inf")
    return logits.softmax(-1), q


class AcceptanceConformance(Conformance):
    family = "acceptance"
    draws: ClassVar[int] = 3000  # per chi-square check

    @pytest.fixture(scope="class")
    @classmethod
    def rule(cls, backend_class, backend_options) -> AcceptanceRule:
        return backend_class(backend_options)

    def decide(self, rule: AcceptanceRule, p, q, draft, gen) -> Decision:
        out = rule.accept(p, q, draft, gen)
        if not (isinstance(out, tuple) and len(out) == 2):
            fail(f"{self.label()}: accept returned {out!r}, not a Decision(num_accepted, tokens)")
        return Decision(*out)

    def check_shape(self, out: Decision, draft: list[int], where: str) -> None:
        m, tokens = out
        assert 0 <= m <= len(draft), f"{where}: {m} accepted of {len(draft)} drafts"
        assert len(tokens) == m + 1, f"{where}: {len(tokens)} tokens for {m} accepted (expected {m + 1})"
        assert list(tokens[:m]) == list(draft[:m]), f"{where}: accepted tokens {tokens[:m]} != draft {draft[:m]}"
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens), f"{where}: tokens {tokens}"

    # -- the checks -----------------------------------------------------------------------
    def test_lossy_flag_matches_the_feature(self, backend_class):
        assert isinstance(backend_class.lossy, bool), "`lossy` must be a bool"
        assert (LOSSY in backend_class.capabilities.features) == backend_class.lossy, (
            f"{self.label()}: lossy={backend_class.lossy} but capabilities.features="
            f"{sorted(backend_class.capabilities.features)}: a lossy rule lists {LOSSY!r}, an exact one not")

    def test_verdicts_are_well_formed(self, rule):
        gen = torch.Generator().manual_seed(0)
        for k in range(5):
            for seed in range(6):
                p, q = random_chain(k, seed, zeros=seed % 2 == 1)
                draft = [draw(q[j], gen) for j in range(k)]
                self.check_shape(self.decide(rule, p, q, draft, gen), draft, f"k={k} seed={seed}")
                self.check_shape(self.decide(rule, p, None, draft, gen), draft, f"k={k} seed={seed} q=None")
                greedy = rule.accept_greedy(p.log(), draft)
                self.check_shape(Decision(*greedy), draft, f"greedy k={k} seed={seed}")

    def test_same_seed_same_verdicts(self, rule, backend_class, backend_options):
        def run(r: AcceptanceRule) -> list:
            gen = torch.Generator().manual_seed(7)
            out = []
            for seed in range(20):
                p, q = random_chain(3, seed)
                draft = [draw(q[j], gen) for j in range(3)]
                out.append(tuple(self.decide(r, p, q, draft, gen)))
            return out

        assert run(rule) == run(rule) == run(backend_class(backend_options))

    def test_emits_its_declared_distribution(self, rule):
        """The first emitted token, draft drawn from q: chi-square against the declared law."""
        for seed, zeros in ((1, False), (2, True)):
            p, q = random_chain(2, seed, zeros)
            declared = rule.emitted_distribution(p[0], q[0])
            assert torch.isclose(declared.sum(), torch.tensor(1.0, dtype=declared.dtype), atol=1e-6)
            assert not (declared[p[0] == 0] > 0).any(), f"{self.label()} declares tokens p rules out"
            counts = self.first_tokens(rule, p, q, lambda gen, q=q: [draw(q[0], gen), draw(q[1], gen)], seed)
            pvalue = chi_square_pvalue(counts, declared)
            assert pvalue > ALPHA, f"{self.label()}: emitted {counts.tolist()} vs declared {declared.tolist()}"

    def test_deterministic_drafts_emit_the_declared_distribution(self, rule):
        p, _ = random_chain(1, 3)
        for token in (int(p[0].argmax()), int(p[0].argmin())):
            declared = rule.emitted_distribution(p[0], None, token)
            counts = self.first_tokens(rule, p, None, lambda gen, t=token: [t], 4)
            assert chi_square_pvalue(counts, declared) > ALPHA, (
                f"{self.label()}: draft {token} (q None): emitted {counts.tolist()} vs {declared.tolist()}")

    def test_lossless_rule_emits_the_target(self, rule, backend_class):
        if backend_class.lossy:
            pytest.skip(f"{self.label()} is lossy: its tokens follow its declared law, not p")
        for seed, zeros in ((5, False), (6, True)):
            p, q = random_chain(2, seed, zeros)
            assert torch.allclose(rule.emitted_distribution(p[0], q[0]), p[0])
            counts = self.first_tokens(rule, p, q, lambda gen, q=q: [draw(q[0], gen), draw(q[1], gen)], seed)
            assert chi_square_pvalue(counts, p[0]) > ALPHA, f"{self.label()}: {counts.tolist()} vs p {p[0].tolist()}"
        for seed in range(10):
            p, q = random_chain(3, seed)
            draft = q.argmax(-1).tolist()
            assert tuple(rule.accept_greedy(p.log(), draft)) == tuple(greedy_prefix(p.log(), draft))

    def first_tokens(self, rule, p, q, make_draft, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        counts = torch.zeros(VOCAB)
        for _ in range(self.draws):
            counts[self.decide(rule, p, q, make_draft(gen), gen).tokens[0]] += 1
        return counts
