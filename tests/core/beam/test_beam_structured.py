"""Beam search under structured output: every beam's logprobs are masked by its own matcher.

References: transformers' ``generate(num_beams=...)`` with a ``LogitsProcessor`` that masks each
beam's row by a fresh matcher fed that beam's tokens (nothing of the engine's matcher forks,
rollbacks or mask rows); an unconstrained beam search where the constraint allows every token
the beams pick; and the outputs' validity (``jsonschema``, ``re.fullmatch``, the choices).
Both grammar engines, and matchers that cannot be copied (rolled back and replayed instead).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

import jsonschema
import pytest
from support.beam_refs import hf_beams, matcher_mask
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import make_engine, run
from support.structured import SCHEMAS, json_model

from lmplug.interfaces.constraint import Matcher, StructuredOutput
from lmplug.interfaces.params import SamplingParams

BACKENDS = ["xgrammar", "llguidance"]
PROMPTS = [[1, 261, 67], [1, 300, 301, 302, 303, 50]]
REGEX = r"[a-z]{2,5}-\d{2}"
SPECS = {"regex": {"regex": REGEX}, "choice": {"choice": ["Paris", "Rome", "Oslo"]},
         "json": {"json": SCHEMAS["flat"]}}
PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 400}
EOS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return json_model(tmp_path_factory.mktemp("beam_structured"))


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in SPECS["choice"]["choice"]
    jsonschema.validate(json.loads(text), SCHEMAS["flat"])
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("width,n,lp,early", [(4, 4, 1.0, False), (3, 2, 0.5, True)])
def test_matches_transformers_with_the_same_masks(model, backend, kind, width, n, lp, early):
    engine = make_engine(model.path, structured_output={"backend": backend}, kvcache=PAGED)
    spec = StructuredOutput(**SPECS[kind])
    params = SamplingParams(beam_width=width, n=n, max_tokens=40, length_penalty=lp, early_stopping=early,
                            structured=spec)
    outs = run(engine, PROMPTS, params)
    backend_obj = engine.constraints.backend
    compiled = backend_obj.compile_cached(spec)
    for prompt, out in zip(PROMPTS, outs):
        mask = matcher_mask(lambda: backend_obj.matcher(compiled), len(prompt), {EOS})
        ref, ref_scores = hf_beams(model.hf, prompt, width=width, n=n, max_new=40, eos=EOS, length_penalty=lp,
                                   early_stopping=early, logits_processor=mask)
        assert [c.token_ids for c in out.outputs] == ref
        assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] == EOS
            assert valid(kind, c.text), c.text
    assert engine.kv.usage == 0 and not engine.constraints._states


class NoCopy(Matcher):
    """A matcher the engine cannot copy (``fork`` is the base class's: None); ``can_undo``: how
    many tokens its rollback can undo (past that it raises, as a bounded history would)."""

    log: ClassVar[list[int]] = []  # every rollback asked for; refused ones negative

    def __init__(self, inner: Matcher, can_undo: int) -> None:
        self.inner, self.can_undo = inner, can_undo

    def accept(self, token: int) -> bool:
        return self.inner.accept(token)

    def fill_mask(self, row) -> None:
        self.inner.fill_mask(row)

    def rollback(self, num_tokens: int) -> None:
        NoCopy.log.append(num_tokens if num_tokens <= self.can_undo else -num_tokens)
        if num_tokens > self.can_undo:
            raise ValueError(f"rollback({num_tokens}): at most {self.can_undo}")
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_complete(self) -> bool:
        return self.inner.is_complete()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("can_undo", [1000, 0])
def test_matchers_that_cannot_be_copied_roll_back_and_replay(model, backend, can_undo):
    """Without ``Matcher.fork`` a beam that takes over another's tokens rolls its own matcher back
    to the tokens both share and replays the rest (``can_undo=1000``), or replays them all from a
    fresh matcher (``can_undo=0``): the same outputs as with copies."""
    params = SamplingParams(beam_width=4, n=4, max_tokens=40, structured=SPECS["json"])
    copied = run(make_engine(model.path, structured_output={"backend": backend}, kvcache=PAGED), PROMPTS, params)
    engine = make_engine(model.path, structured_output={"backend": backend}, kvcache=PAGED)
    fresh = engine.constraints.backend.matcher
    engine.constraints.backend.matcher = lambda compiled: NoCopy(fresh(compiled), can_undo)
    NoCopy.log.clear()
    replayed = run(engine, PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in replayed] == [[c.token_ids for c in o.outputs] for o in copied]
    # beams diverged and were rolled back; or the rollback was refused and a fresh matcher replayed
    assert any(k > 0 for k in NoCopy.log) if can_undo else any(k < 0 for k in NoCopy.log)


def test_equals_unconstrained_where_the_constraint_allows_the_beams_picks(tmp_path_factory):
    """An ASCII vocabulary and a regex allowing any text: the constrained search is the free one.
    A regex that forbids some of the tokens the free beams pick changes them."""
    tm = get_model("llama", tmp_path_factory.mktemp("beam_ascii"), tokenizer=True)
    engine = make_engine(tm.path, structured_output={"backend": "xgrammar"}, kvcache=PAGED)
    prompts = PROMPTS + [[1, 70, 71, 72]]
    free = run(engine, prompts, SamplingParams(beam_width=4, n=4, max_tokens=12))
    anything = run(engine, prompts, SamplingParams(beam_width=4, n=4, max_tokens=12,
                                                   structured={"regex": r"[\s\S]*"}))
    no_angles = run(engine, prompts, SamplingParams(beam_width=4, n=4, max_tokens=12,
                                                    structured={"regex": r"[^<>]*"}))
    tokens = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]
    assert tokens(anything) == tokens(free)
    assert [[c.score for c in o.outputs] for o in anything] == [[c.score for c in o.outputs] for o in free]
    assert any("<" in c.text for o in free for c in o.outputs)
    assert tokens(no_angles) != tokens(free)
    assert all("<" not in c.text for o in no_angles for c in o.outputs)


PRESSURE = {  # preemption under a tight pool, chunked prefill, the contiguous cache (row copies)
    "recompute": {"kvcache": {**PAGED, "num_blocks": 20}, "scheduler": {"backend": "continuous"}},
    "swap": {"kvcache": {**PAGED, "num_blocks": 20, "swap_space_gb": 0.01},
             "scheduler": {"backend": "continuous", "preemption": "swap"}},
    "chunked": {"kvcache": PAGED, "scheduler": {"backend": "continuous", "max_num_batched_tokens": 3}},
    "contiguous": {"kvcache": {"backend": "contiguous"}},
}


@pytest.mark.parametrize("setup", sorted(PRESSURE))
def test_constrained_beams_under_pressure_equal_the_roomy_run(model, setup):
    """Two constrained beam groups and a free greedy request: what each gives alone, with room."""
    prompts = [prompt_ids(13, seed=s) for s in (1, 2, 3)]
    params = [SamplingParams(beam_width=4, n=2, max_tokens=40, structured=SPECS["json"]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(beam_width=3, n=3, max_tokens=40, structured=SPECS["regex"])]
    roomy = make_engine(model.path, structured_output={"backend": "xgrammar"}, kvcache=PAGED)
    alone = [run(roomy, [p], q)[0] for p, q in zip(prompts, params)]
    engine = make_engine(model.path, structured_output={"backend": "xgrammar"}, **PRESSURE[setup])
    outs = run(engine, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in alone]
    if setup in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions > 0
    assert valid("json", outs[0].outputs[0].text) and valid("regex", outs[2].outputs[0].text)
