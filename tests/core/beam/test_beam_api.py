"""``LLM.beam_search`` (vLLM's shape) and the errors bad beam settings get, naming the field."""

from __future__ import annotations

import pytest
from support.beam_refs import hf_beams
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401

from lmplug import BeamSearchParams, ConfigError, SamplingParams

PAGED = {"kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 256}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("beam_api"))


def test_beam_search_returns_vllm_shape(tiny):
    ids = prompt_ids(10, seed=4)
    ref, ref_scores = hf_beams(tiny.hf, ids, width=3, n=3, max_new=5, eos=None, length_penalty=0.5)
    outs = tiny.llm(**PAGED).beam_search([{"prompt_token_ids": ids}],
                                         BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True,
                                                          length_penalty=0.5))
    seqs = outs[0].sequences
    assert [s.output_token_ids for s in seqs] == ref
    assert all(s.tokens == ids + s.output_token_ids for s in seqs)
    assert [s.score for s in seqs] == pytest.approx(ref_scores, abs=1e-4)
    assert all(s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("kwargs,field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 4, "num_return_sequences": 3}, "num_return_sequences"),
    ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_bad_beam_search_params(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_sampling_params_for_beams():
    with pytest.raises(ConfigError, match="n"):
        SamplingParams(n=3, beam_width=2)
    with pytest.raises(ConfigError, match="beam_width"):
        SamplingParams(beam_width=-1)


def test_engine_refuses_what_beams_cannot_do(tiny):
    llm = tiny.llm(**PAGED)
    ids = prompt_ids(6, seed=1)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        llm.generate([ids], SamplingParams(beam_width=9))  # the default max_num_seqs is 8
    with pytest.raises(ConfigError, match="repetition_penalty"):
        llm.generate([ids], SamplingParams(beam_width=2, repetition_penalty=1.2))


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("frequency_penalty", -0.5),
                                         ("logit_bias", {5: 1.0}), ("logprobs", 1), ("prompt_logprobs", 0)])
def test_lossy_settings_are_refused_naming_them(tiny, field, value):
    with pytest.raises(ConfigError, match=field):
        tiny.llm(**PAGED).generate([prompt_ids(6, seed=1)], SamplingParams(beam_width=2, **{field: value}))


def test_speculative_decoding_is_refused_naming_it(tiny):
    llm = tiny.llm(**PAGED, speculative={"method": "ngram", "num_tokens": 2})
    with pytest.raises(ConfigError, match="speculative"):
        llm.generate([prompt_ids(6, seed=1)], SamplingParams(beam_width=2))
    assert llm.generate([prompt_ids(6, seed=1)], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_refusals_name_what_beams_cannot_do():
    """A KV cache that cannot fork (or, under tensor parallelism, repeat its copies on every rank)
    is refused, naming the features; structured output is admitted (test_beam_structured.py)."""
    from lmplug.beam.stage import check_beam_request
    from lmplug.interfaces.constraint import StructuredOutput

    with pytest.raises(ConfigError, match="fork_copy.*tensor parallelism.*tp_copies"):
        check_beam_request(SamplingParams(beam_width=2), max_num_seqs=8, can_fork=False, speculative=False)
    structured = SamplingParams(beam_width=2, structured=StructuredOutput(regex="a+"))
    check_beam_request(structured, max_num_seqs=8, can_fork=True, speculative=False)
