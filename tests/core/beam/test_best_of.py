"""``best_of`` without beams (OpenAI / vLLM): best_of samples, the n with the highest cumulative
logprob returned, that logprob checked against transformers' on the same tokens."""

from __future__ import annotations

import pytest
from support.hf_models import get_model, hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401

from lmplug import ConfigError, SamplingParams


def _hf_cum(hf, prompt: list[int], output: list[int]) -> float:
    lps = hf_logprobs(hf, prompt + output)  # row p: log-softmax of the logits after token p
    return float(sum(lps[len(prompt) - 1 + j, t] for j, t in enumerate(output)))


@pytest.mark.parametrize("kv", ["paged", "contiguous"])
def test_best_of_returns_the_n_most_likely_samples(tmp_path_factory, kv):
    tm = get_model("llama", tmp_path_factory.mktemp(f"best_of_{kv}"))
    llm = tm.llm(kvcache={"backend": kv})
    ids = prompt_ids(10, seed=6)
    common = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "seed": 13}
    samples = llm.generate([ids], SamplingParams(n=5, **common))[0].outputs  # the same 5 draws (same seeds)
    cums = [_hf_cum(tm.hf, ids, c.token_ids) for c in samples]
    assert len({tuple(c.token_ids) for c in samples}) > 2  # distinct samples: the ranking is not moot
    out = llm.generate([ids], SamplingParams(n=2, best_of=5, **common))[0]
    order = sorted(range(5), key=lambda i: -cums[i])[:2]
    assert [c.token_ids for c in out.outputs] == [samples[i].token_ids for i in order]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([cums[i] for i in order], abs=1e-4)
    assert all(c.logprobs is None for c in out.outputs)  # recorded for the ranking, not asked for
    assert [c.index for c in out.outputs] == [0, 1]


@pytest.mark.parametrize("kwargs", [{"n": 3, "best_of": 2}, {"best_of": 0}, {"beam_width": 2, "best_of": 2}])
def test_bad_best_of(kwargs):
    with pytest.raises(ConfigError, match="best_of"):
        SamplingParams(**kwargs)
