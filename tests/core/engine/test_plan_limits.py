"""The plan decides the limits: a KV pool smaller than ``max_model_len`` lowers it in the plan,
and the KV spec, the scheduler's limits and the engine then hold the same value (the build used
to clamp the engine's copy only, leaving ``kv.spec.max_model_len`` at the configured one)."""

from __future__ import annotations

import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError

POOL = {"backend": "paged", "block_size": 4, "num_blocks": 10}  # 40 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("plan_limits"))


def build(model, max_model_len: int = 256, **kvcache) -> LLM:
    """A fresh engine (not ``model.llm``'s cached one: other tests read the clamp's warning)."""
    return LLM(str(model.path), dtype="float32", device="cpu", max_model_len=max_model_len,
               kvcache={**POOL, **kvcache})


def limits(engine) -> dict:
    return {"plan": engine.parts.plan.max_model_len, "engine": engine.max_model_len,
            "kv.spec": engine.kv.spec.max_model_len, "scheduler": engine.scheduler.limits.max_model_len,
            "requests": engine.requests.max_model_len}


def test_a_small_pool_lowers_max_model_len_everywhere(model):
    engine = build(model).engine
    assert limits(engine) == dict.fromkeys(limits(engine), 40)
    assert engine.kv.pool_blocks() == 10  # the rebuilt cache keeps the pool's blocks


def test_a_pool_that_holds_max_model_len_changes_nothing(model):
    engine = build(model, num_blocks=128).engine
    assert limits(engine) == dict.fromkeys(limits(engine), 256)


def test_clamped_engine_generates_as_one_configured_with_that_limit(model):
    """Greedy tokens and logprobs of the clamped engine equal those of an engine given
    max_model_len=40 from the start, and a prompt past it is refused when it arrives."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    prompts = [[5, 17, 42, 9], [7, 8, 9, 10, 11]]
    clamped = build(model)
    direct = build(model, max_model_len=40)
    got, want = clamped.generate(prompts, params), direct.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [len(o.token_ids) for o in got] == [30, 30]
    assert [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in got] == \
        [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in want]
    with pytest.raises(ConfigError, match="max_model_len=40"):
        clamped.generate([list(range(3, 50))], params)


def test_every_holder_of_the_limit_agrees_after_the_plan_with_a_drafter_and_beams(model):
    """Nothing clamps after the plan: with a draft model (a cache of its own, sized by the
    target's ``DraftTarget``), the beam stage and the lifecycle hooks' view, every copy of
    ``max_model_len`` is the plan's, and a drafted run stops at it as a plain one does."""
    from lmplug.beam.stage import BeamStage

    llm = LLM(str(model.path), dtype="float32", device="cpu", max_model_len=256, kvcache=POOL,
              speculative={"method": "draft_model", "model": str(model.path), "num_tokens": 3})
    engine = llm.engine
    seen = {**limits(engine), "view": engine.view.max_model_len,
            "beam": engine.selector.find(BeamStage).max_model_len,
            "draft kv.spec": engine.speculator.drafter.runner.kv.spec.max_model_len}
    assert seen == dict.fromkeys(seen, 40)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    out = llm.generate([[5, 17, 42, 9]], params)[0]
    assert len(out.token_ids) == 36 and out.finish_reason == "length"
    assert out.token_ids == build(model, max_model_len=40).generate([[5, 17, 42, 9]], params)[0].token_ids
