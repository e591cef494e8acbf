"""Speculative decoding in the engine, on a tiny random Llama.

Greedy: outputs equal non-speculative greedy decoding with a drafter that is right at some
positions and wrong at others, for both KV backends (the paged one with prefix caching and
under preemption) and both schedulers, including token budgets that cut drafts. Stop
tokens, stop strings and max_tokens that fall inside an accepted run end the output there.
Sampling: the distribution of sampled continuations is the target's (chi-square against
probabilities computed with transformers), and a verifier without the residual correction
fails that check.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import (
    STAT_PROMPT,
    TABLE,
    chi_square_pvalue,
    make_engine,
    pair_counts,
    record_reference,
    run,
    target_probs,
)

from lmplug.interfaces.params import SamplingParams
from lmplug.kit import sampling as kit_sampling

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [prompt_ids(3, 11), prompt_ids(17, 12), prompt_ids(40, 13), [7, 8, 9, 10] * 5]
ORACLE = {"method": "test_oracle", "num_tokens": 3, "wrong_every": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("spec"), tokenizer=True)


@pytest.fixture(scope="module")
def reference(model):
    return record_reference(model.path, PROMPTS, GREEDY)


PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 200}
CASES = {
    "contiguous-continuous": {},
    "paged-continuous": {"kvcache": PAGED},
    "paged-prefix-continuous": {"kvcache": {**PAGED, "prefix_caching": True}},
    "paged-preempting": {"kvcache": {**PAGED, "num_blocks": 40}},
    "contiguous-static": {"scheduler": "static"},
    "paged-static": {"kvcache": PAGED, "scheduler": "static"},
    "budget-cuts-drafts": {"kvcache": PAGED, "scheduler": {"backend": "continuous",
                                                             "max_num_batched_tokens": 6}},
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_greedy_speculation_equals_plain_greedy(model, reference, case):
    engine = make_engine(model.path, ORACLE, **case)
    outs = run(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    # sometimes right, sometimes wrong
    assert 0.2 < engine.speculator.num_accepted / engine.speculator.num_drafted < 0.9
    assert engine.kv.usage == 0  # every block came back
    if case.get("kvcache", {}).get("num_blocks") == 40:
        assert engine.scheduler.num_preemptions > 0


def test_drafts_are_cut_to_the_budget(model, reference):
    """A budget below 1 + k: the decode still runs, with the drafts that fit."""
    engine = make_engine(model.path, ORACLE, scheduler={"backend": "continuous", "max_num_batched_tokens": 3})
    outs = run(engine, PROMPTS[:1], GREEDY, max_steps=100)
    assert outs[0].token_ids == reference[0]
    assert engine.speculator.num_drafted > 0


def test_rollback_releases_blocks_past_the_accepted_tokens(model, reference):
    """After every step a paged sequence holds just the blocks of its computed tokens: those
    that only rejected drafts reached went back to the pool."""
    engine = make_engine(model.path, {**ORACLE, "num_tokens": 8}, kvcache=PAGED)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    free_blocks = engine.kv.num_blocks
    while engine.has_unfinished_requests():
        engine.step()
        held = 0
        for seq in engine.scheduler.running:
            table = engine.kv.block_table(seq)
            assert len(table) == -(-seq.num_computed_tokens // 4), seq
            held += len(table)
        assert len(engine.kv.blocks.free_block_ids) == free_blocks - held


def test_rolled_back_blocks_never_enter_the_prefix_cache(model, reference):
    """Run the prompts twice through a prefix-caching paged cache with a drafter that is often
    wrong: the second run reuses cached blocks and must still decode the reference."""
    engine = make_engine(model.path, ORACLE, kvcache={**PAGED, "prefix_caching": True})
    run(engine, PROMPTS, GREEDY)
    blocks = engine.kv.blocks
    assert len(blocks.free_block_ids) + len(blocks.cached_block_ids) == blocks.num_blocks
    # prompt + output as the new prompt: its blocks are served from the cache
    again = [p + r[:-1] for p, r in zip(PROMPTS, reference)]
    plain = run(make_engine(model.path), again, GREEDY)
    outs = run(engine, again, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_stats_and_per_request_counts(model, reference):
    engine = make_engine(model.path, ORACLE)
    outs = run(engine, PROMPTS, GREEDY)
    stats = engine.last_stats
    assert stats["spec_acceptance_rate"] == engine.speculator.num_accepted / engine.speculator.num_drafted
    assert 0 < stats["spec_mean_accepted"] <= ORACLE["num_tokens"]
    seqs = [o.metrics for o in outs]
    assert sum(m.num_drafted_tokens for m in seqs) == engine.speculator.num_drafted
    assert sum(m.num_accepted_tokens for m in seqs) == engine.speculator.num_accepted


# -- stop conditions inside an accepted run -------------------------------------------------------
ALWAYS_RIGHT = {"method": "test_oracle", "num_tokens": 4, "wrong_every": 0}


def inside_a_run(index: int) -> bool:
    """With k=4 and every draft accepted, output 0 comes from the prompt's step and then each
    step emits outputs 5r+1 .. 5r+5; ``index`` is inside a run if a later one follows it."""
    return index >= 1 and index % 5 != 0


def _compare(model, params: SamplingParams) -> list:
    prompt = PROMPTS[1]
    plain = run(make_engine(model.path), [prompt], params)[0]
    engine = make_engine(model.path, ALWAYS_RIGHT)
    spec = run(engine, [prompt], params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text
    assert (spec.finish_reason, spec.outputs[0].stop_reason) == (plain.finish_reason, plain.outputs[0].stop_reason)
    assert engine.speculator.num_accepted > 0 or len(plain.token_ids) <= 2  # (no room for drafts)
    return spec.token_ids


def test_stop_token_inside_an_accepted_run(model, reference):
    ref = reference[1]
    i = next(i for i in range(2, len(ref)) if inside_a_run(i) and ref[i] not in ref[:i])
    tokens = _compare(model, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                            stop_token_ids=[ref[i]]))
    assert len(tokens) == i + 1


def test_stop_string_inside_an_accepted_run(model, reference):
    ref, tok = reference[1], model.llm().tokenizer
    i = next(i for i in range(2, len(ref)) if inside_a_run(i)
             and tok.decode(ref[i - 1:i + 1]) not in tok.decode(ref[:i]))
    tokens = _compare(model, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                            stop=tok.decode(ref[i - 1:i + 1])))
    assert len(tokens) == i + 1


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 9])
def test_max_tokens(model, reference, max_tokens):
    tokens = _compare(model, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert tokens == reference[1][:max_tokens]


def test_context_limit(model, reference):
    """Drafts never run past max_model_len; the output ends there as without speculation."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    prompt = PROMPTS[1]  # 17 tokens: 13 fit before the limit of 30
    engine = make_engine(model.path, ALWAYS_RIGHT, max_model_len=30, kvcache={**PAGED, "num_blocks": 8})
    spec = run(engine, [prompt], params)[0]
    assert spec.token_ids == reference[1][:13]
    assert spec.finish_reason == "length"
    assert engine.speculator.num_accepted > 0
    assert engine.scheduler.num_preemptions == 0  # no draft asked for a slot past the limit


def test_logprobs_of_accepted_tokens(model, reference):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    plain = run(make_engine(model.path), PROMPTS[:2], params)
    spec = run(make_engine(model.path, ORACLE), PROMPTS[:2], params)
    for p, s in zip(plain, spec):
        assert len(s.logprobs) == len(s.token_ids) == len(p.logprobs)
        for lp_plain, lp_spec in zip(p.logprobs, s.logprobs):
            assert lp_plain.keys() == lp_spec.keys()
            for tid in lp_plain:
                assert lp_plain[tid].rank == lp_spec[tid].rank
                assert lp_plain[tid].logprob == pytest.approx(lp_spec[tid].logprob, abs=1e-4)


# -- sampling: the target distribution, exactly -------------------------------------------------


@pytest.fixture(scope="module")
def pair_distribution(model):
    """P(first two output tokens) from transformers, and a draft table for the second one that
    overweights the target's least likely choice and proposes a token outside its support."""
    p1 = target_probs(model.hf, STAT_PROMPT)
    firsts = p1.nonzero().flatten().tolist()
    expected = {}
    for t1 in firsts:
        p2 = target_probs(model.hf, STAT_PROMPT + [t1])
        support = sorted(p2.nonzero().flatten().tolist(), key=lambda t: float(p2[t]))
        outside = next(t for t in range(3, 512) if p2[t] == 0)
        q = torch.zeros(512, dtype=torch.float64)
        q[support[0]], q[support[-1]], q[outside] = 0.5, 0.2, 0.3
        TABLE[tuple(STAT_PROMPT + [t1])] = q
        for t2 in support:
            expected[(t1, t2)] = float(p1[t1] * p2[t2])
    return expected


def _pair_counts(model, expected: dict, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    engine = make_engine(model.path, {"method": "test_table", "num_tokens": 2},
                         scheduler={"backend": "continuous", "max_num_seqs": 128})
    return pair_counts(engine, expected, num, accepted=(0.1, 0.9))


def test_sampled_continuations_follow_the_target(model, pair_distribution):
    counts, probs = _pair_counts(model, pair_distribution, 1200)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_biased_verifier_is_caught(model, pair_distribution, monkeypatch):
    monkeypatch.setattr(kit_sampling, "residual_distribution", lambda p, q: p)
    counts, probs = _pair_counts(model, pair_distribution, 1200)
    assert chi_square_pvalue(counts, probs) < 1e-3
