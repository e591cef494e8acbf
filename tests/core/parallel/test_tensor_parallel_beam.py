"""Beam search under tensor parallelism (gloo, CPU): TP=2 gives what TP=1 gives.

A beam that takes over another's tokens forks its KV: copy-on-write block copies (paged) or a row
copy (contiguous) that rank 0's cache records and every worker repeats on its own pool before the
next forward (the "tp_copies" feature). Without them the workers' K/V of forked beams would be
stale and the outputs would differ. Greedy requests and a beam group under a JSON schema share
the steps; prompts are prefilled in chunks.
"""

from __future__ import annotations

import pytest
from support.hf_models import one_torch_thread  # noqa: F401 - fixture
from support.structured import SCHEMAS, json_model
from support.tensor_parallel import PROMPTS, tp

from lmplug import LLM, SamplingParams

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "structured_output": {"backend": "xgrammar"},
          "scheduler": {"backend": "continuous", "max_num_batched_tokens": 24, "max_num_seqs": 8}}
CACHES = {"paged": {"backend": "paged", "block_size": 4, "num_blocks": 256}, "contiguous": {"backend": "contiguous"}}
PARAMS = [SamplingParams(beam_width=4, n=4, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(beam_width=3, n=2, max_tokens=40, length_penalty=0.5, structured={"json": SCHEMAS["flat"]}),
          SamplingParams(beam_width=2, n=2, max_tokens=8, ignore_eos=True)]


def results(llm: LLM):
    outs = llm.generate(PROMPTS[:len(PARAMS)], PARAMS)
    return [[c.token_ids for c in o.outputs] for o in outs], [[c.score for c in o.outputs] for o in outs]


@pytest.mark.parametrize("cache", ["paged", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_beams_tp2_equal_tp1(tmp_path_factory, cache):
    path = json_model(tmp_path_factory.getbasetemp() / "tp_beam_models").path
    single = LLM(str(path), **ENGINE, kvcache=CACHES[cache])
    want_tokens, want_scores = results(single)
    parallel = LLM(str(path), **ENGINE, **tp(2), kvcache=CACHES[cache])
    try:
        kv, copies = parallel.engine.kv, []
        take = kv.take_copies
        kv.take_copies = lambda: copies.append(take()) or copies[-1]
        tokens, scores = results(parallel)
    finally:
        parallel.close()
    assert tokens == want_tokens
    for got, want in zip(scores, want_scores):
        assert got == pytest.approx(want, abs=1e-4)
    assert any(copies)  # forks copied blocks / rows, and the workers were sent them
    assert len(tokens[0]) == 4 and len(tokens[2]) == 2
