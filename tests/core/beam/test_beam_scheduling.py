"""Beam groups under the continuous scheduler: chunked prefill with small budgets, preemption
(recompute and swap) under memory pressure, and ordinary requests finishing while a beam runs.
Each beam group must equal its unpressured run (and transformers)."""

from __future__ import annotations

import pytest
from support.beam_refs import hf_beams
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401

from lmplug import SamplingParams

BEAM = SamplingParams(n=3, beam_width=3, max_tokens=10, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("beam_sched"))


def _run(llm, requests):
    """Step the engine by hand; returns each request's final output and the step it finished in."""
    engine = llm.engine
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        assert step < 500, "the engine stopped making progress"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out, step)
    return done


@pytest.mark.parametrize("budget,kv", [(3, "paged"), (7, "paged"), (5, "contiguous")])
def test_chunked_prefill_small_budget(tiny, budget, kv):
    """Contiguous: each beam prefills its own row, so the beams' prompts end in different steps
    and the group waits for the last one."""
    ids = prompt_ids(17, seed=8)
    ref, ref_scores = hf_beams(tiny.hf, ids, width=3, n=3, max_new=10, eos=None)
    cache = {"backend": "paged", "block_size": 4, "num_blocks": 128} if kv == "paged" else {"backend": kv}
    llm = tiny.llm(kvcache=cache, scheduler={"backend": "continuous", "max_num_batched_tokens": budget})
    out, _ = _run(llm, [("b", ids, BEAM)])["b"]
    assert [c.token_ids for c in out.outputs] == ref
    assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-4)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_beams_equal_unpressured_run(tiny, preemption):
    """Two beam groups and greedy requests in a pool too small for all: beams are preempted, and
    every output equals the same requests run alone with room to spare."""
    prompts = [prompt_ids(13, seed=s) for s in (1, 2, 3)]
    reqs = [("b0", prompts[0], BEAM), ("g", prompts[1], SamplingParams(temperature=0, max_tokens=12,
                                                                       ignore_eos=True)),
            ("b1", prompts[2], BEAM)]
    roomy = tiny.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 256})
    alone = {rid: _run(roomy, [(rid, ids, p)])[rid][0] for rid, ids, p in reqs}
    tight = tiny.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 24, "swap_space_gb": 0.01},
                     scheduler={"backend": "continuous", "preemption": preemption})
    done = _run(tight, reqs)
    assert tight.engine.scheduler.num_preemptions > 0
    for rid, _, _ in reqs:
        got, want = done[rid][0], alone[rid]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert tight.engine.kv.blocks.num_used_blocks == 0
    ref, _ = hf_beams(tiny.hf, prompts[0], width=3, n=3, max_new=10, eos=None)
    assert [c.token_ids for c in done["b0"][0].outputs] == ref


@pytest.mark.parametrize("kv", [{"backend": "paged", "block_size": 4, "num_blocks": 256},
                                {"backend": "contiguous"}])
def test_plain_request_finishes_while_beam_runs(tiny, kv):
    """A short greedy request added beside a long beam search finishes long before it, and both
    equal their runs alone."""
    beam_ids, plain_ids = prompt_ids(11, seed=4), prompt_ids(9, seed=5)
    long_beam = SamplingParams(n=2, beam_width=4, max_tokens=20, ignore_eos=True)
    llm = tiny.llm(kvcache=kv)
    done = _run(llm, [("beam", beam_ids, long_beam), ("plain", plain_ids, GREEDY)])
    assert done["plain"][1] < done["beam"][1] - 10
    assert done["plain"][0].outputs[0].token_ids == llm.generate([plain_ids], GREEDY)[0].outputs[0].token_ids
    ref, _ = hf_beams(tiny.hf, beam_ids, width=4, n=2, max_new=20, eos=None)
    assert [c.token_ids for c in done["beam"][0].outputs] == ref


def test_group_ending_while_a_beam_waits_frees_every_beam(tiny):
    """Width 4 over a 3-token prompt with a budget of 3 tokens a step: the beams' prefills and
    decodes fall in different steps, and the group ends in a step some beams did not run in.
    Those beams are finished for the scheduler too (they were left running for ever) and their
    blocks go back."""
    ids = prompt_ids(3, seed=2)
    ref, ref_scores = hf_beams(tiny.hf, ids, width=4, n=2, max_new=3, eos=None)
    llm = tiny.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 64},
                   scheduler={"backend": "continuous", "max_num_batched_tokens": 3})
    out, _ = _run(llm, [("b", ids, SamplingParams(n=2, beam_width=4, max_tokens=3, ignore_eos=True))])["b"]
    assert [c.token_ids for c in out.outputs] == ref
    assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
    assert llm.engine.scheduler.num_running == 0 and llm.engine.kv.blocks.num_used_blocks == 0


def test_beam_swapped_out_while_waiting_for_its_group(tiny):
    """A beam swapped out after computing everything it had (it was waiting for its siblings)
    comes back with nothing to compute: it runs its last token again for its logits. (It was
    scheduled with no tokens: an empty step crashed, a shared one read a neighbour's row.)"""
    prompts = [prompt_ids(13, seed=s) for s in (1, 2, 3)]
    reqs = [("b0", prompts[0], SamplingParams(beam_width=4, n=2, max_tokens=12, ignore_eos=True)),
            ("g", prompts[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
            ("b1", prompts[2], SamplingParams(beam_width=3, n=3, max_tokens=8, ignore_eos=True))]
    roomy = tiny.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 256})
    alone = {rid: _run(roomy, [(rid, ids, p)])[rid][0] for rid, ids, p in reqs}
    tight = tiny.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 16, "swap_space_gb": 0.01},
                     scheduler={"backend": "continuous", "preemption": "swap"})
    done = _run(tight, reqs)
    assert tight.engine.scheduler.num_swaps > 0
    for rid, _, _ in reqs:
        assert [c.token_ids for c in done[rid][0].outputs] == [c.token_ids for c in alone[rid].outputs]
    ref, _ = hf_beams(tiny.hf, prompts[0], width=4, n=2, max_new=12, eos=None)
    assert [c.token_ids for c in done["b0"][0].outputs] == ref
    assert tight.engine.kv.blocks.num_used_blocks == 0
