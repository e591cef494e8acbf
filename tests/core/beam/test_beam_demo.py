"""The demo model (SmolLM2-135M), dequantised from its GGUF to a dense fp32 HF checkpoint by
transformers' own GGUF reader: lmplug's beam search on that checkpoint equals transformers'
``generate(num_beams=...)`` on the same weights, token for token, scores within 1e-4."""

from __future__ import annotations

import pytest
from support.beam_refs import hf_beams
from support.demo_dense import dense_demo
from support.hf_models import one_torch_thread  # noqa: F401

from lmplug import LLM, SamplingParams


@pytest.mark.slow
def test_demo_model_beams_match_transformers(demo_gguf, tmp_path):
    hf = dense_demo(demo_gguf, tmp_path / "dense")
    ids = [1, 504, 3458, 282, 4114, 314, 253, 2378, 30, 378, 2378, 314]  # fixed ids: no tokenizer needed
    eos = 2  # SmolLM2's <|im_end|> ends a beam if one reaches it
    ref, ref_scores = hf_beams(hf, ids, width=4, n=3, max_new=12, eos=eos, length_penalty=1.0)
    llm = LLM(str(tmp_path / "dense"), dtype="float32", device="cpu", max_model_len=128,
              kvcache={"backend": "paged", "block_size": 16, "num_blocks": 64})
    params = SamplingParams(n=3, beam_width=4, max_tokens=12, stop_token_ids=[eos], ignore_eos=True)
    out = llm.generate([ids], params)[0]
    assert [c.token_ids for c in out.outputs] == ref
    assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
