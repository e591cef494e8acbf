"""Beam search equals transformers' ``generate(num_beams=...)`` token for token, scores within 1e-4."""

from __future__ import annotations

import pytest
from support.beam_refs import frequent_token, hf_beams
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401

from lmplug import SamplingParams

CASES = [  # width, n, max_new, length_penalty, early_stopping, min_tokens, with eos
    (4, 2, 10, 1.0, False, 0, True),
    (3, 3, 8, 0.0, "never", 0, True),
    (4, 1, 9, 2.0, True, 0, True),
    (2, 2, 7, -0.5, "never", 3, True),
    (5, 5, 6, 1.0, False, 0, False),
]


@pytest.mark.parametrize("width,n,max_new,lp,early,min_tokens,with_eos", CASES)
def test_beam_matches_transformers(tmp_path_factory, width, n, max_new, lp, early, min_tokens, with_eos):
    tm = get_model("llama", tmp_path_factory.mktemp("beam"))
    ids = prompt_ids(12, seed=width * 7 + max_new)
    eos = frequent_token(tm.hf, ids) if with_eos else None
    ref, ref_scores = hf_beams(tm.hf, ids, width=width, n=n, max_new=max_new, eos=eos, length_penalty=lp,
                               early_stopping=early, min_new=min_tokens)
    llm = tm.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 256})
    params = SamplingParams(n=n, beam_width=width, max_tokens=max_new, length_penalty=lp, early_stopping=early,
                            min_tokens=min_tokens, stop_token_ids=[] if eos is None else [eos],
                            ignore_eos=True)
    out = llm.generate([ids], params)[0]
    got = [c.token_ids for c in out.outputs]
    assert got == ref
    assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
    for c in out.outputs:  # the cumulative logprob is the score before the length penalty
        assert c.cumulative_logprob == pytest.approx(c.score * len(c.token_ids) ** lp, abs=1e-3)
