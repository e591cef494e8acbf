"""``draft_length: cost`` (lmplug.speculative.draft_length): how many of a chain's drafts a step
verifies, from the forward times by row count and each sequence's recent acceptance.

The choice is checked against the arithmetic it stands for (expected tokens over cost, with
E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k), on cost tables set by hand; in an engine, with a cost table that
makes long verifies dear, greedy output stays plain decoding's while fewer drafts are verified,
and a seeded sampling request keeps every draft (its text then depends on its seed alone).
"""

from __future__ import annotations

import pytest
from support.hf_models import get_model, prompt_ids
from support.spec_helpers import make_engine, record_reference, run

from lmplug.interfaces.params import SamplingParams
from lmplug.speculative.draft_length import DECAY, OPTIMISM, PRIOR_WEIGHT, DraftLength


def controller(costs: dict[int, float], a: float | list[float] | None = None) -> DraftLength:
    """Forwards timed as ``costs`` says; sequence 7's acceptance ``a``: one rate for every
    draft position, or one per position (None: the prior)."""
    dl = DraftLength()
    for rows, seconds in costs.items():
        dl.observe_forward(rows, seconds)
    if a is not None:
        dl.acceptance = lambda seq_id, depth: (list(a) if isinstance(a, list) else [a] * depth)[:depth]
    return dl


def best_by_hand(a: float | list[float], costs: dict[int, float], proposed: int) -> int:
    per = a if isinstance(a, list) else [a] * proposed
    reach = [1.0]
    for rate in per[:proposed]:
        reach.append(reach[-1] * rate)
    rates = [sum(reach[:k + 1]) / costs[k + 1] for k in range(proposed + 1)]
    return max(range(proposed + 1), key=lambda k: (rates[k], -k))


CPU_LIKE = {1: 1.0, 2: 1.07, 3: 1.25, 4: 1.6, 5: 1.85}  # the demo model's verifies, one thread
FLAT = {1: 1.0, 2: 1.0, 3: 1.01, 4: 1.01, 5: 1.02}  # a GPU's


@pytest.mark.parametrize("costs", [CPU_LIKE, FLAT], ids=["cpu-like", "flat"])
@pytest.mark.parametrize("a", [0.05, 0.3, 0.6, 0.8, 0.95])
def test_the_choice_maximises_expected_tokens_per_second(costs, a):
    assert controller(costs, a).choose(7, 4, 0) == best_by_hand(a, costs, 4)


@pytest.mark.parametrize("a", [[0.3, 0.9, 0.9, 0.9], [0.6, 0.95, 0.95, 0.95], [0.7, 0.4, 0.2, 0.1]])
def test_each_position_has_its_own_rate(a):
    """A first draft often rejected but the ones after it kept (a copied span once it is found):
    one rate for all would cut the drafts that pay."""
    assert controller(CPU_LIKE, a).choose(7, 4, 0) == best_by_hand(a, CPU_LIKE, 4)
    assert controller(CPU_LIKE, [0.6, 0.95, 0.95, 0.95]).choose(7, 4, 0) == 4
    first_only = sum(0.6 ** i for i in range(5)) / CPU_LIKE[5]  # one rate, 0.6: 4 drafts rate less
    assert first_only < (1 + 0.6) / CPU_LIKE[2]


def test_long_drafts_where_verifies_are_flat_or_acceptance_high_short_or_none_where_not():
    assert controller({r: 1.0 for r in range(1, 6)}, 0.2).choose(7, 4, 0) == 4  # flat: every draft
    assert controller(CPU_LIKE, 0.95).choose(7, 4, 0) == 4  # inside a copied span
    assert controller(CPU_LIKE).choose(7, 4, 0) == 1  # the prior a = 0.5: 1.5 / 1.07 beats 1.75 / 1.25
    assert controller(CPU_LIKE, 0.03).choose(7, 4, 0) == 0  # drafts stopped paying: plain steps
    assert controller(CPU_LIKE, 0.9).choose(7, 0, 0) == 0
    assert DraftLength().choose(7, 4, 0) == 4  # nothing timed yet: what was proposed


def test_acceptance_follows_the_text_and_recovers_after_plain_steps():
    dl = DraftLength()
    assert dl.acceptance(1, 3) == [0.5, 0.5, 0.5]  # the prior: one accept, one reject, every position
    dl.observe_verify(1, 4, 4)  # 4 of 4: positions 1-4 judged and accepted
    a1 = 2 / 3
    a2 = (1 + PRIOR_WEIGHT * a1) / (1 + PRIOR_WEIGHT)
    assert dl.acceptance(1, 2) == pytest.approx([a1, a2])
    dl.observe_verify(1, 4, 1)  # 1 of 4: position 1 accepted, 2 rejected, 3 and 4 not judged
    a1 = (DECAY + 1 + 1) / (DECAY + 1 + 2)  # the first verify's counts decayed, plus this one's
    a2 = (DECAY + PRIOR_WEIGHT * a1) / (DECAY + 1 + PRIOR_WEIGHT)  # accepted then, rejected now
    a3 = (DECAY + PRIOR_WEIGHT * a2) / (DECAY + PRIOR_WEIGHT)  # judged then only
    assert dl.acceptance(1, 3) == pytest.approx([a1, a2, a3])
    copy = DraftLength()  # the first draft kept half the time, every later one kept
    for _ in range(10):
        copy.observe_verify(1, 4, 4)
        copy.observe_verify(1, 4, 0)
    first, *later = copy.acceptance(1, 4)
    assert 0.4 < first < 0.6 and all(a > 0.8 for a in later)
    low = DraftLength()
    for _ in range(10):
        low.observe_verify(1, 2, 0)
    before = low.acceptance(1, 1)[0]
    for _ in range(10):
        low.observe_verify(1, 0, 0)  # plain steps: the counts fade toward the prior
    assert before < 0.2 and 0.4 < low.acceptance(1, 1)[0] <= 0.5
    low.release(1)
    assert low.acceptance(1, 2) == [0.5, 0.5]


def test_an_unmeasured_row_count_is_assumed_cheap_until_tried():
    dl = controller({1: 1.0, 3: 1.3})
    assert dl.forward_cost(3) == 1.3
    assert dl.forward_cost(5) == pytest.approx(1.3 + 2 * OPTIMISM)
    assert dl.forward_cost(2) == pytest.approx(1.0 + OPTIMISM)
    only_verifies = controller({3: 1.2})  # below every measured count, the same rule backwards
    assert only_verifies.forward_cost(1) == pytest.approx(1.2 / (1 + 2 * OPTIMISM))
    dl.observe_forward(5, 2.0)
    dl.observe_forward(5, 3.0)  # a moving average
    assert dl.forward_cost(5) == pytest.approx(2.0 + 0.3 * 1.0)


def test_drafting_time_counts_before_the_drafter_runs_not_after():
    """A drafter that costs 0.8 of a forward per token (a model's first layers): at a = 0.5 no
    draft pays for its drafting, so none is asked for; once drafted, one is worth verifying."""
    dl = controller(CPU_LIKE, 0.5)
    dl.observe_draft(2, 1.6)
    assert dl.draft_token_cost == pytest.approx(0.8)
    assert dl.choose(7, 4, 0, drafting=True) == 0
    assert dl.choose(7, 4, 0) == 1
    dl.observe_draft(4, 0.0004)  # a cheap one moves the average
    assert dl.draft_token_cost == pytest.approx(0.8 + 0.3 * (0.0001 - 0.8))


def test_other_sequences_rows_count():
    """Four sequences in a step: their rows and tokens count, so a draft's marginal row is
    weighed against the whole step (at a = 0.5 one sequence alone would verify 2)."""
    costs = {1: 1.0, 2: 1.07, 3: 1.25, 4: 1.3, 5: 1.4, 6: 1.5, 7: 1.9, 8: 2.4}
    k = controller(costs, 0.5).choose(7, 4, 3)
    rates = [(3 + sum(0.5 ** i for i in range(j + 1))) / costs[4 + j] for j in range(5)]
    assert k == max(range(5), key=lambda j: (rates[j], -j))


# -- in an engine --------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [prompt_ids(3, 11), prompt_ids(17, 12)]
ORACLE = {"method": "test_oracle", "num_tokens": 4, "wrong_every": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("draft_length"), tokenizer=True)


@pytest.fixture(scope="module")
def reference(model):
    return record_reference(model.path, PROMPTS, GREEDY)


def dear_verifies(engine) -> DraftLength:
    """The engine's controller with its timings replaced by a table where each row past two
    costs as much as a step: one draft a step pays at best."""
    dl = engine.speculator.draft_length
    dl.observe_forward = lambda rows, seconds: None
    dl.cost.update({1: 1.0, 2: 1.05, **{r: float(r) for r in range(3, 20)}})
    return dl


def test_greedy_output_is_plain_decodings_with_fewer_drafts(model, reference):
    fixed = make_engine(model.path, ORACLE)
    assert fixed.speculator.draft_length is None
    assert run(fixed, PROMPTS[:1], GREEDY)[0].token_ids == reference[0]
    cost = make_engine(model.path, {**ORACLE, "draft_length": "cost"})
    dear_verifies(cost)
    assert run(cost, PROMPTS[:1], GREEDY)[0].token_ids == reference[0]
    spec = cost.speculator
    assert 0 < spec.num_drafted <= spec.num_verified  # at most one draft a verify
    assert spec.num_drafted < fixed.speculator.num_drafted


def test_a_drafter_that_does_not_pay_is_not_asked(model, reference, monkeypatch):
    """Drafting that costs ten forwards a token, verifies timed: the drafter is never asked,
    and the output is plain decoding's."""
    engine = make_engine(model.path, {**ORACLE, "draft_length": "cost"})
    dl = dear_verifies(engine)
    dl.observe_draft = lambda tokens, seconds: None
    dl.draft_token_cost = 10.0
    asked = []
    propose = engine.speculator.drafter.propose
    monkeypatch.setattr(engine.speculator.drafter, "propose", lambda seqs, k: asked.append(k) or propose(seqs, k))
    assert run(engine, PROMPTS[:1], GREEDY)[0].token_ids == reference[0]
    assert asked == [] and engine.speculator.num_drafted == 0


def test_timed_forwards_fill_the_cost_table(model, reference):
    engine = make_engine(model.path, {**ORACLE, "draft_length": "cost"})
    run(engine, PROMPTS[:1], GREEDY)
    dl = engine.speculator.draft_length
    assert dl.cost and all(rows >= 1 and seconds > 0 for rows, seconds in dl.cost.items())
    assert max(dl.cost) <= 1 + ORACLE["num_tokens"]  # decode and verify rows, no prefill
    assert dl.draft_token_cost is not None and dl.draft_token_cost > 0


def test_a_seeded_sampling_request_keeps_every_draft(model, reference):
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)
    outs = []
    for dear in (False, True):
        engine = make_engine(model.path, {**ORACLE, "draft_length": "cost"})
        if dear:
            dear_verifies(engine)
        outs.append((run(engine, PROMPTS[:1], sampled)[0].token_ids, engine.speculator.num_drafted))
    assert outs[0] == outs[1]
