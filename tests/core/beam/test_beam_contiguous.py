"""Beam search on the contiguous KV cache (beams fork by copying rows) equals transformers'."""

from __future__ import annotations

import pytest
from support.beam_refs import frequent_token, hf_beams
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401

from lmplug import SamplingParams


@pytest.mark.parametrize("name,width", [("llama", 4), ("mistral", 3)])
def test_contiguous_beams_match_transformers(tmp_path_factory, name, width):
    tm = get_model(name, tmp_path_factory.mktemp(f"contig_{name}"))
    ids = prompt_ids(20, seed=11)  # longer than mistral's window of 16: the ring wraps
    eos = frequent_token(tm.hf, ids)
    ref, ref_scores = hf_beams(tm.hf, ids, width=width, n=2, max_new=9, eos=eos)
    # exactly `width` rows: the reorder needs no spare row
    llm = tm.llm(kvcache={"backend": "contiguous", "max_num_seqs": width},
                 scheduler={"max_num_seqs": width})
    params = SamplingParams(n=2, beam_width=width, max_tokens=9, stop_token_ids=[eos], ignore_eos=True)
    out = llm.generate([ids], params)[0]
    assert [c.token_ids for c in out.outputs] == ref
    assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
    assert not llm.engine.kv._row_of  # every beam's row came back
