"""Structured output in the engine, on a tiny random Llama with a byte-level tokenizer.

A random model writes anything; under a constraint every output must parse and validate
(``jsonschema``), fully match its regex, or be one of its choices — with both grammar engines,
greedy and seeded sampling, ``n > 1``. The masks must not change anything else: unconstrained
rows in a mixed batch decode exactly as without constrained neighbours, and speculative decoding
(drafts checked against the constraint, the matcher rolled back), preemption (recompute) and
chunked prefill give the plain run's tokens. A bad constraint fails its request at admission.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from support.hf_models import one_torch_thread  # noqa: F401 - fixture
from support.spec_helpers import REFERENCE, make_engine, run
from support.structured import SCHEMAS, json_model

from lmplug.interfaces.constraint import ConstraintError, StructuredOutput
from lmplug.interfaces.params import SamplingParams

BACKENDS = ["xgrammar", "llguidance"]
PROMPTS = [[1, 261, 67], [1, 300, 301, 302, 303, 50], [1, 70, 71, 72]]
REGEX = r"[a-z]{2,5}-\d{2}"
CHOICES = ["Paris", "Rome", "Oslo"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return json_model(tmp_path_factory.mktemp("structured"))


def engine_for(model, backend: str, speculative: dict | None = None, **overrides):
    return make_engine(model.path, speculative, constraint={"backend": backend}, **overrides)


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_greedy_and_sampled(model, backend, name):
    schema = SCHEMAS[name]
    engine = engine_for(model, backend)
    params = [SamplingParams(temperature=0, max_tokens=200, structured=StructuredOutput(json=schema)),
              SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=200, structured={"json": schema})]
    for p in params:
        for out in run(engine, PROMPTS[:2], p):
            for completion in out.outputs:
                assert completion.finish_reason == "stop", completion
                check_json(completion.text, schema)
    assert engine.kv.usage == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_choice_and_any_object(model, backend):
    engine = engine_for(model, backend)
    for p, check in [
        (SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=40, structured={"regex": REGEX}),
         lambda t: re.fullmatch(REGEX, t)),
        (SamplingParams(temperature=1.0, seed=4, n=4, max_tokens=40, structured={"choice": CHOICES}),
         lambda t: t in CHOICES),
    ]:
        for out in run(engine, PROMPTS, p):
            for completion in out.outputs:
                assert completion.finish_reason == "stop"
                assert check(completion.text), completion.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_json_object(model, backend):
    """Any object: a random model may nest without end, so a cut output must be a valid prefix."""
    engine = engine_for(model, backend)
    spec = StructuredOutput(json_object=True)
    outs = run(engine, PROMPTS, SamplingParams(temperature=0.7, seed=6, max_tokens=120, structured=spec))
    for out in outs:
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:
            assert completion.finish_reason == "length" and completion.text.lstrip().startswith("{")
            matcher = engine.constraints.backend.matcher(engine.constraints.backend.compile_cached(spec))
            assert all(matcher.accept(t) for t in completion.token_ids)


def test_unconstrained_rows_decode_as_without_neighbours(model):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = run(engine_for(model, "xgrammar"), PROMPTS, free)
    constrained = SamplingParams(temperature=0, max_tokens=30, structured={"regex": REGEX})
    mixed = run(engine_for(model, "xgrammar"), PROMPTS + PROMPTS, [free] * 3 + [constrained] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in mixed[3:])


PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 200}
SETUPS = {
    "preempting": {"kvcache": {**PAGED, "num_blocks": 36}},
    "chunked-prefill": {"kvcache": PAGED, "scheduler": {"backend": "continuous", "max_num_batched_tokens": 3}},
    "speculative": {"speculative": {"method": "test_oracle", "num_tokens": 3, "wrong_every": 3}},
    "speculative-paged": {"kvcache": PAGED,
                          "speculative": {"method": "test_oracle", "num_tokens": 4, "wrong_every": 2}},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setup", SETUPS, ids=list(SETUPS))
def test_same_tokens_under_speculation_preemption_and_chunking(model, backend, setup):
    schema = SCHEMAS["nested"]
    params = SamplingParams(temperature=0, max_tokens=120, structured={"json": schema})
    prompts = PROMPTS + [p + [40, 41] for p in PROMPTS]
    plain = run(engine_for(model, backend), prompts, params)
    for prompt, out in zip(prompts, plain):  # the oracle drafter proposes these (wrong at times)
        REFERENCE[tuple(prompt)] = out.outputs[0].token_ids
    case = dict(SETUPS[setup])
    engine = engine_for(model, backend, case.pop("speculative", None), **case)
    outs = run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    for out in outs:
        check_json(out.outputs[0].text, schema)
    if "speculative" in setup:
        assert engine.speculator.num_accepted > 0 and engine.speculator.num_accepted < engine.speculator.num_drafted
    if setup == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_length_cut_is_a_valid_prefix(model):
    engine = engine_for(model, "xgrammar")
    spec = StructuredOutput(json=SCHEMAS["defs"])
    out = run(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, structured=spec))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    matcher = engine.constraints.backend.matcher(engine.constraints.backend.compile_cached(spec))
    assert all(matcher.accept(t) for t in out.token_ids)
    assert not matcher.is_complete()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec, field", [
    ({"regex": "(ab"}, "regex"),
    ({"json": {"type": "nonsense"}}, "json"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
])
def test_bad_constraints_fail_at_admission(model, backend, spec, field):
    engine = engine_for(model, backend)
    with pytest.raises(ConstraintError) as info:
        engine.add_request("bad", PROMPTS[0], SamplingParams(structured=spec))
    assert info.value.field == field
    assert not engine.has_unfinished_requests()
    # the engine keeps serving
    out = run(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
