"""Continuous batching: every request's greedy output equals running it alone, whatever
happens around it (preemption under a tiny KV pool, chunked prefill, aborts, late arrivals)."""

import random

import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)

from lmplug import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("cont"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 60))] for _ in range(7)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    llm = model.llm(scheduler="static", kvcache="contiguous")
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def continuous(model, num_blocks=64, budget=2048, max_seqs=8, **sched):
    return model.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": num_blocks},
                     scheduler={"backend": "continuous", "max_num_batched_tokens": budget,
                                "max_num_seqs": max_seqs, **sched})


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_matches_alone(model, prompts, alone, budget):
    llm = continuous(model, budget=budget)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone


def test_preemption_under_tiny_pool_matches_alone(model, prompts, alone):
    # 40 blocks of 4 tokens = 160 slots for 7 sequences of up to ~84 tokens: must preempt
    llm = continuous(model, num_blocks=40, budget=32)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.kv.usage == 0


def test_late_arrivals_and_aborts(model, prompts, alone):
    llm = continuous(model, num_blocks=48, budget=16)
    engine = llm.engine
    done = {}
    engine.add_request("a0", prompts[0], GREEDY)
    engine.add_request("doomed", prompts[1], GREEDY)
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if step == 3:
            engine.abort_request("doomed")
        if step < len(prompts) - 2:  # one request joins per step while others run
            engine.add_request(f"a{step}", prompts[step + 1], GREEDY)
    assert "doomed" not in done
    for step in range(1, len(prompts) - 2):
        assert done[f"a{step}"].token_ids == alone[step + 1]
    assert done["a0"].token_ids == alone[0]
    assert engine.kv.usage == 0 and not engine.has_unfinished_requests()


def test_priority_policy_runs_urgent_first(model, prompts):
    llm = continuous(model, max_seqs=1, policy="priority")
    engine = llm.engine
    for i, prio in enumerate([5, 0, 9]):
        engine.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0, max_tokens=2), priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["r1", "r0", "r2"]


def test_budgets_respected_every_step(model, prompts):
    llm = continuous(model, num_blocks=40, budget=7, max_seqs=3)
    engine, sched = llm.engine, llm.engine.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    real = sched.schedule

    def checked():
        out = real()
        assert out.num_tokens <= 7 and len(out.scheduled) <= 3
        return out

    sched.schedule = checked
    while engine.has_unfinished_requests():
        engine.step()


def test_unchunked_budget_below_the_context_is_refused_at_load(model, prompts, alone):
    """Without chunked prefill a prompt longer than the budget could never be admitted: the
    config is refused naming the option, and a budget that holds the context runs."""
    from lmplug import LLM
    from lmplug.errors import ConfigError

    with pytest.raises(ConfigError, match="max_num_batched_tokens .*64.* max_model_len .*256"):
        LLM(str(model.path), device="cpu", dtype="float32", max_model_len=256,
            scheduler={"backend": "continuous", "max_num_batched_tokens": 64, "chunked_prefill": False})
    outs = continuous(model, budget=256, chunked_prefill=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
