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
