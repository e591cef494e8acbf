"""The speculative verifier: greedy acceptance, and speculative sampling that keeps the target
distribution exactly (chi-square over many seeded draws on small vocabularies), with the
sampling filters applied to both distributions. A verifier without the residual correction
fails the same check. Engine-level tests: test_spec_engine.py."""

from __future__ import annotations

import pytest
import torch
from support.spec_helpers import chi_square_pvalue

from lmplug.interfaces.params import SamplingParams
from lmplug.kit import sampling as kit_sampling
from lmplug.kit.sampling import draw, processed_logits
from lmplug.speculative.verifier import verify_batch, verify_greedy, verify_sampling

ALPHA = 1e-3  # a correct verifier fails a check once in a thousand seeds; these seeds are fixed

# p: the target's next-token distributions at draft positions 0, 1, 2; q: the draft's.
# q puts mass where p has little (token 3) and little where p has much (token 0), so
# acceptance is partial and the residual matters.
P = torch.tensor([[0.45, 0.25, 0.15, 0.05, 0.10],
                  [0.10, 0.20, 0.30, 0.30, 0.10],
                  [0.30, 0.30, 0.20, 0.10, 0.10]], dtype=torch.float64)
Q = torch.tensor([[0.05, 0.20, 0.15, 0.50, 0.10],
                  [0.40, 0.10, 0.10, 0.20, 0.20]], dtype=torch.float64)


def emitted_counts(num_trials: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Draft 2 tokens from Q, verify against P; count the first emitted token, and the second
    one when the first draft was accepted. Returns (counts1, counts2, mean accepted)."""
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(5), torch.zeros(5)
    accepted = 0
    for _ in range(num_trials):
        draft = [draw(Q[0], gen), draw(Q[1], gen)]
        verdict = verify_sampling(P, Q, draft, gen)
        first[verdict.tokens[0]] += 1
        if verdict.num_accepted >= 1:
            second[verdict.tokens[1]] += 1
        accepted += verdict.num_accepted
    return first, second, accepted / num_trials


def test_speculative_sampling_emits_the_target_distribution():
    first, second, mean_accepted = emitted_counts(8000)
    assert chi_square_pvalue(first, P[0]) > ALPHA
    assert chi_square_pvalue(second, P[1]) > ALPHA  # after an accepted draft: the next position's p
    # acceptance is partial: the probability of accepting draft 0 is sum(min(p, q))
    assert 0.3 < mean_accepted < 1.5


def test_without_the_residual_correction_the_check_fails(monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection biases the output
    (towards the tokens q over-proposes); the same chi-square check must catch it."""
    monkeypatch.setattr(kit_sampling, "residual_distribution", lambda p, q: p)
    first, _, _ = emitted_counts(8000)
    assert chi_square_pvalue(first, P[0]) < ALPHA


def test_deterministic_drafts_are_exact():
    """No draft distribution (n-gram, greedy draft): q is a point mass on the proposal."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(5)
    for i in range(8000):
        verdict = verify_sampling(P[:2], None, [i % 5], gen)  # a proposal that ignores p
        counts[verdict.tokens[0]] += 1
    assert chi_square_pvalue(counts, P[0]) > ALPHA


def test_bonus_token_after_all_drafts_accepted():
    """Drafts equal to p are always accepted; the bonus token then comes from p[k]."""
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(5)
    for _ in range(6000):
        draft = [draw(P[0], gen), draw(P[1], gen)]
        verdict = verify_sampling(P, P[:2], draft, gen)
        assert verdict.num_accepted == 2 and verdict.tokens[:2] == draft
        counts[verdict.tokens[2]] += 1
    assert chi_square_pvalue(counts, P[2]) > ALPHA


FILTERS = [
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.25),
]


@pytest.mark.parametrize("params", FILTERS, ids=["temperature", "top_k", "top_p", "min_p"])
def test_filters_shape_both_distributions(params):
    """Target and draft logits go through the same temperature / top-k / top-p / min-p; the
    emitted token follows the *filtered* target distribution."""
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(2, 8, generator=g)
    draft_logits = target_logits + torch.randn(2, 8, generator=g)
    q = processed_logits(draft_logits[:1], [params]).softmax(-1)
    expected = processed_logits(target_logits[:1], [params]).softmax(-1)[0]
    if params.needs_filtering:  # the filter removed tokens and left a choice
        assert (expected == 0).sum() >= 2 and (expected > 0).sum() >= 2
    gen = torch.Generator().manual_seed(4)
    n = 6000  # as many sequences in one batch, each with one draft and the same logits
    drafts = [[draw(q[0], gen)] for _ in range(n)]
    verdicts = verify_batch(target_logits.repeat(n, 1), [2] * n, [params] * n, drafts, [q] * n, [gen] * n)
    counts = torch.bincount(torch.tensor([v.tokens[0] for v in verdicts]), minlength=8).float()
    assert chi_square_pvalue(counts, expected) > ALPHA


def test_greedy_accepts_the_longest_agreeing_prefix():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 1, 4]):
        logits[row, best] = 3.0
    assert verify_greedy(logits, [2, 5, 1]).tokens == [2, 5, 1, 4]  # all accepted + bonus
    assert verify_greedy(logits, [2, 0, 1]).tokens == [2, 5]  # correction at the first miss
    assert verify_greedy(logits, [3, 5, 1]).tokens == [2]
    assert verify_greedy(logits[:1], []).tokens == [2]


def test_batch_acceptance_lengths_differ_per_sequence():
    """Three sequences with 2, 0 and 3 drafts share one logits tensor; each gets its own
    acceptance length, and greedy and sampling sequences mix."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3 + 1 + 4, 16, generator=g)
    best = logits.argmax(-1).tolist()
    drafts = [[best[0], (best[1] + 1) % 16], [], best[4:7]]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0)]
    gens = [None, torch.Generator().manual_seed(1), None]
    verdicts = verify_batch(logits, [3, 1, 4], params, drafts, [None, None, None], gens)
    assert [v.num_accepted for v in verdicts] == [1, 0, 3]
    assert verdicts[0].tokens == [best[0], best[1]]
    assert verdicts[2].tokens == best[4:8]
    # a sequence without drafts samples exactly as the plain sampler would (same generator draw)
    probs = processed_logits(logits[3:4], [params[1]]).softmax(-1)[0]
    assert verdicts[1].tokens == [draw(probs, torch.Generator().manual_seed(1))]


def test_rows_must_match_drafts():
    with pytest.raises(ValueError, match="2 draft tokens need 3 logits rows"):
        verify_batch(torch.zeros(2, 4), [2], [SamplingParams(temperature=0)], [[1, 2]], [None], [None])
