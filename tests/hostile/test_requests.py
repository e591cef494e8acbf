"""One request never hurts another; capacity is known at start (engine level).

Each test is a reproduction from the hardening issue: out-of-range parameters are refused
when ``SamplingParams`` is built, a row that raises in the step fails its own request only,
an observer plugin that raises reaches no request, one request with many samples cannot
starve a later one, and a KV cache too small for the configuration says so at start-up.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)

from lmplug import SamplingParams
from lmplug.errors import ConfigError
from lmplug.hookspecs import hookimpl
from lmplug.interfaces.params import GREEDY_EPSILON, MAX_STOP_CHARS, MAX_STOP_STRINGS
from lmplug.plugins import get_registry

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9], [7, 8, 9, 10, 11], [100, 200, 300]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("hostile"))


def continuous(model, **kv):
    return model.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 128, **kv},
                     scheduler={"backend": "continuous", "max_num_seqs": 8})


# -- parameters validated into range -------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", -2), ("seed", 2**64), ("seed", -1), ("n", 65), ("n", 0),
    ("temperature", float("inf")), ("temperature", float("nan")), ("top_p", float("nan")),
    ("min_p", float("inf")), ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", ["x" * (MAX_STOP_CHARS + 1)]),
    ("stop_token_ids", [2**64]),
])
def test_out_of_range_params_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field}=.* is invalid: expected"):
        SamplingParams(**{field: value})


def test_edges_of_the_ranges_are_accepted():
    SamplingParams(top_k=2**31 - 1, seed=2**64 - 1, n=64, stop=["y" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)


def test_tiny_temperature_is_greedy(model):
    """temperature 1e-40 used to divide logits to inf and return token 0 over and over."""
    assert SamplingParams(temperature=1e-40).is_greedy
    assert not SamplingParams(temperature=GREEDY_EPSILON).is_greedy
    llm = continuous(model)
    tiny = llm.generate(PROMPTS, SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True))
    greedy = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_largest_seed_with_many_samples_runs(model):
    out = continuous(model).generate([PROMPTS[0]], SamplingParams(n=3, seed=2**64 - 1, max_tokens=4))
    assert len(out[0].outputs) == 3


def test_lone_surrogate_prompt_is_refused(tmp_path_factory):
    tok_model = get_model("llama", tmp_path_factory.mktemp("hostile-tok"), tokenizer=True)
    with pytest.raises(ConfigError, match="prompt: not valid Unicode"):
        tok_model.llm(kvcache="contiguous").generate(["a\udc80b"], GREEDY)


# -- one failing request, the others finish ------------------------------------------------------


def run_all(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("kv", ["paged", "contiguous"])
def test_a_row_that_raises_fails_its_request_only(model, kv):
    """top_k >= 2**63 (set after validation, as a plugin or a bug could) raised in the step and
    gave every request in flight a 500."""
    llm = continuous(model) if kv == "paged" else model.llm(scheduler="continuous")
    alone = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    bad = SamplingParams(temperature=0.8, top_k=5, max_tokens=8, seed=1)
    bad.top_k = 2**63  # "Overflow when unpacking long long"
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    seeded_alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
    done = run_all(llm.engine, {"ok0": (PROMPTS[0], GREEDY), "bad": (PROMPTS[1], bad),
                                "ok2": (PROMPTS[2], GREEDY), "seeded": (PROMPTS[0], seeded)})
    assert done["bad"].outputs[0].finish_reason == "error"
    assert [done["ok0"].token_ids, done["ok2"].token_ids] == [alone[0], alone[2]]
    assert done["seeded"].token_ids == seeded_alone  # redrawn from the state before the failed batch
    assert llm.engine.kv.usage == 0 and len(llm.engine.requests) == 0


def test_a_row_that_raises_under_speculation_fails_its_request_only(model):
    """The speculator verifies the batch in one pass; when that raises it verifies one sequence
    at a time, so only the bad request fails and the others keep their exact output."""
    llm = model.llm(scheduler="continuous", speculative={"method": "ngram", "num_tokens": 3})
    alone = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    bad = SamplingParams(temperature=0.8, top_k=5, max_tokens=8, seed=1)
    bad.top_k = 2**63  # past validation: the batched verify raises
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    seeded_alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
    done = run_all(llm.engine, {"ok0": (PROMPTS[0], GREEDY), "bad": (PROMPTS[1], bad),
                                "ok2": (PROMPTS[2], GREEDY), "seeded": (PROMPTS[0], seeded)})
    assert done["bad"].outputs[0].finish_reason == "error"
    assert [done["ok0"].token_ids, done["ok2"].token_ids] == [alone[0], alone[2]]
    assert done["seeded"].token_ids == seeded_alone
    assert llm.engine.kv.usage == 0 and len(llm.engine.requests) == 0


def test_a_failing_output_stage_fails_its_request_and_its_siblings(model, monkeypatch):
    llm = continuous(model)
    alone = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    engine = llm.engine
    real = engine.requests.append

    def append(seqs, *args):
        if seqs[0].request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer failed")
        return real(seqs, *args)

    monkeypatch.setattr(engine.requests, "append", append)
    sampled = SamplingParams(n=3, temperature=0.7, max_tokens=8, seed=3)
    done = run_all(engine, {"ok": (PROMPTS[0], GREEDY), "bad": (PROMPTS[1], sampled)})
    assert [c.finish_reason for c in done["bad"].outputs] == ["error"] * 3
    assert done["ok"].token_ids == alone
    assert engine.kv.usage == 0 and not engine.has_unfinished_requests()


# -- observer hooks isolated ---------------------------------------------------------------------


def test_a_raising_observer_reaches_no_request(model, caplog):
    calls = []

    def boom(**_):
        calls.append(1)
        raise RuntimeError("observer bug")

    plugin = types.SimpleNamespace(LMPLUG_API_VERSION=3)
    for name in ("lmplug_request_finished", "lmplug_step_finished", "lmplug_engine_started"):
        setattr(plugin, name, hookimpl(specname=name)(lambda engine, _n=name, **kw: boom()))
    registry = get_registry()
    assert registry.register(plugin, name="boom-observer", distribution="boom-dist 0.1")
    try:
        with caplog.at_level(logging.ERROR, logger="lmplug.engine.engine"):
            llm = model.llm(kvcache="contiguous", scheduler="continuous", seed=123)  # a fresh engine
            outs = llm.generate(PROMPTS, GREEDY)
    finally:
        registry.pm.unregister(name="boom-observer")
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert len(calls) > 3
    logged = [r.getMessage() for r in caplog.records if "boom-observer" in r.getMessage()]
    assert len(logged) == 3  # once per plugin and hook
    assert all("boom-dist 0.1" in m for m in logged)


# -- fair admission ------------------------------------------------------------------------------


def test_small_request_finishes_while_a_big_one_runs(model):
    """A request of 64 samples used to hold the queue: a later 4-token request waited behind
    every one of them. Now requests are admitted round-robin (at equal priority)."""
    llm = model.llm(kvcache="contiguous", scheduler={"backend": "continuous", "max_num_seqs": 4})
    engine = llm.engine
    engine.add_request("big", PROMPTS[0], SamplingParams(n=64, temperature=0.9, max_tokens=6, seed=5))
    engine.step()
    engine.add_request("small", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == ["small", "big"]


def test_priority_still_wins_over_turns(model):
    llm = model.llm(kvcache="contiguous",
                    scheduler={"backend": "continuous", "max_num_seqs": 1, "policy": "priority"})
    engine = llm.engine
    engine.add_request("low", PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=3), priority=5)
    engine.add_request("high", PROMPTS[1], SamplingParams(n=2, temperature=0, max_tokens=3), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


# -- capacity known at start ---------------------------------------------------------------------


def test_small_paged_pool_clamps_max_model_len(model, caplog):
    with caplog.at_level(logging.WARNING, logger="lmplug.engine.plan"):
        llm = model.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 10})
    assert llm.engine.max_model_len == 40
    assert any("kvcache.num_blocks" in r.getMessage() and "max_model_len=256" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match="max_model_len=40"):
        llm.generate([list(range(3, 50))], GREEDY)  # refused when it arrives, not mid-run


def test_contiguous_reservation_past_available_memory_is_refused(model, monkeypatch):
    from lmplug_kvcache import paged

    monkeypatch.setattr(paged, "_mem_available", lambda: 1 << 20)
    with pytest.raises(ConfigError, match=r"max_num_seqs=256.*max_model_len=256.* bytes"):
        model.llm(kvcache="contiguous", scheduler={"backend": "continuous", "max_num_seqs": 256})


def test_static_batch_fits_the_pool_to_the_end(model):
    """The static scheduler checked each sequence alone against the free blocks, so a batch
    overflowed the pool during decode (OutOfBlocksError)."""
    llm = model.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 12},
                    scheduler={"backend": "static", "max_num_seqs": 8})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)  # each needs 6-7 blocks: one batch cannot hold two
    assert [len(o.token_ids) for o in outs] == [20, 20, 20]
    ref = model.llm(kvcache="contiguous", scheduler="static").generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_sampler_redraw_matches_the_batch():
    """A batch that raises while shaping the distributions (here: an out-of-range top_k that got
    past validation) has drawn nothing, so the row-by-row retry gives every other sequence the
    token a batch without the bad row gives, and only the bad row fails."""
    from lmplug.engine.select import Sampler
    from lmplug.interfaces.sequence import Sequence

    def seqs():
        return [Sequence("r", [1, 2], SamplingParams(temperature=0.9, top_k=5, seed=i),
                         generator=torch.Generator().manual_seed(i)) for i in range(3)]

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    good = seqs()
    expected, _ = Sampler().select(logits[[0, 2]], [1, 1], [good[0], good[2]])
    batch = seqs()
    batch[1].params.top_k = 2**63  # past SamplingParams' check: torch cannot hold it
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        Sampler().select(logits, [1, 1, 1], batch)
    failed = []
    again, _ = Sampler().select(logits, [1, 1, 1], batch, on_error=lambda s, e: failed.append(s))
    assert failed == [batch[1]] and again[1] == []
    assert [again[0], again[2]] == expected