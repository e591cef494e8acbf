"""Beam search on the other families (sliding window, MoE, MLA), beside ordinary requests, and
the KV blocks a width-8 search holds against 8 independent copies."""

from __future__ import annotations

import pytest
from support.beam_refs import frequent_token, hf_beams
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401
from support.moe_models import TinyDeepseek, TinyMoE

from lmplug import SamplingParams

PAGED = {"kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 512}}


def _tiny(name: str, root):
    if name == "mistral":
        return get_model("mistral", root)
    if name == "deepseek_v2":
        return TinyDeepseek("q_lora", root)
    return TinyMoE(name, root)


@pytest.mark.parametrize("name", ["mistral", "qwen2_moe", "mixtral", "deepseek_v2"])
def test_beam_matches_transformers_families(tmp_path_factory, name):
    tm = _tiny(name, tmp_path_factory.mktemp(name))
    ids = prompt_ids(20, seed=3)  # longer than mistral's window of 16
    eos = frequent_token(tm.hf, ids)
    ref, ref_scores = hf_beams(tm.hf, ids, width=3, n=3, max_new=8, eos=eos)
    params = SamplingParams(n=3, beam_width=3, max_tokens=8, stop_token_ids=[eos], ignore_eos=True)
    out = tm.llm(**PAGED).generate([ids], params)[0]
    assert [c.token_ids for c in out.outputs] == ref
    assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-4)


def test_beam_beside_ordinary_requests(tmp_path_factory):
    """One batch: a beam group between greedy requests; each equals its own reference."""
    tm = get_model("llama", tmp_path_factory.mktemp("mixed"))
    llm = tm.llm(**PAGED)
    a, b = prompt_ids(9, seed=1), prompt_ids(14, seed=2)
    ref, ref_scores = hf_beams(tm.hf, b, width=4, n=2, max_new=6, eos=None)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([a], greedy)[0].token_ids
    beam = SamplingParams(n=2, beam_width=4, max_tokens=6, ignore_eos=True)
    outs = llm.generate([a, b, a], [greedy, beam, greedy])
    assert outs[0].token_ids == alone == outs[2].token_ids
    assert [c.token_ids for c in outs[1].outputs] == ref
    assert [c.score for c in outs[1].outputs] == pytest.approx(ref_scores, abs=1e-4)


def test_width8_blocks_far_below_eight_copies(tmp_path_factory):
    """A 1k-token prompt, width 8: the beams share the prompt's blocks (copy-on-write)."""
    from lmplug import LLM

    tm = get_model("llama", tmp_path_factory.mktemp("blocks"))
    llm = LLM(str(tm.path), dtype="float32", device="cpu", max_model_len=1100,
              kvcache={"backend": "paged", "block_size": 16, "num_blocks": 1024, "prefix_caching": False})
    engine = llm.engine
    ids = (prompt_ids(256, seed=5) * 4)[:1024]
    engine.add_request("beam", ids, SamplingParams(n=1, beam_width=8, max_tokens=24, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.blocks.num_used_blocks)
    copies = 8 * -(-(1024 + 24) // 16)  # 8 independent sequences of prompt + output
    print(f"width 8 over 1024 prompt tokens: peak {peak} blocks held, 8 copies {copies}")
    assert engine.kv.blocks.num_used_blocks == 0  # every beam's blocks came back
    assert peak < copies / 4
