"""Pipeline parallelism on gloo (CPU): PP=2 and PP=3 (and P x T) give what PP=1 gives.

Each pipeline engine spawns a process per extra stage. The reference is the same model in one
process (itself HF-parity tested in tests/plugins/models); runs use the paged KV cache and the
continuous scheduler with a small token budget (chunked prefill, decodes beside prefills), and
compare tokens, their logprobs and the first prompt's prompt logprobs. Failures and bad input:
test_pipeline_parallel_failure.py.
"""

from __future__ import annotations

import pytest
from support.hf_models import one_torch_thread  # noqa: F401
from support.pipeline_models import LAYERS, save
from support.tensor_parallel import ENGINE, PROMPTS, assert_same, children, run

from lmplug import LLM, ConfigError, SamplingParams

pytestmark = pytest.mark.hf


def pp(p: int, t: int = 1, **extra) -> dict:
    return {"parallel": {"pipeline_parallel_size": p, "tensor_parallel_size": t, **extra}}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save(tmp_path_factory.getbasetemp(), "llama")
    with LLM(str(path), **ENGINE) as single:
        yield path, run(single)


def test_pp2_matches_one_process(llama):
    """The fast default-run check: 2 stages of 2 layers; each stage holds only its layers' weights
    and K/V (the first the embedding, the last the norm and LM head)."""
    path, expected = llama
    with LLM(str(path), **ENGINE, **pp(2)) as parallel:
        assert_same(expected, run(parallel))
        mem, kv = parallel.engine.memory, parallel.engine.kv
        assert mem["pipeline_parallel_size"] == 2 and len(mem["weight_bytes_per_rank"]) == 2
        assert kv.spec.num_layers == LAYERS // 2  # rank 0's cache: its 2 layers
        assert mem["kv_bytes_per_token_per_rank"] == [kv.bytes_per_token] * 2
        model = parallel.engine.parts.model
        owned = [i for i, layer in enumerate(model.layers) if any(True for _ in layer.parameters())]
        assert owned == [0, 1] and model.norm is None and model.embed_tokens is not None
        # each rank's wait for its input over its wall time since the reset (the benchmark's bubble)
        group = parallel.engine.parallel
        group.stage_clocks(reset=True)
        run(parallel, max_tokens=4)
        clocks = group.stage_clocks()
        assert len(clocks) == 2 and all(0 < c["wait_s"] <= c["wall_s"] for c in clocks)


def test_pp2_keeps_two_micro_batches_in_flight(llama):
    """vLLM's virtual engines: two schedulers over disjoint sequences, so the first stage runs
    batch B while the second runs batch A; the tokens stay one process's. A request aborted while
    its batch is in flight ends; the others go on."""
    path, expected = llama
    with LLM(str(path), **ENGINE, **pp(2)) as parallel:
        engine = parallel.engine
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, params)
        seen, outputs = 0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
            seen = max(seen, engine.batches_in_flight)
        assert seen == 2
        assert [outputs[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == [e[0] for e in expected]
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"a{i}", prompt, params)
        while engine.batches_in_flight < 2:
            engine.step()
        engine.abort_request("a0")
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        assert "a0" not in done or done["a0"].outputs[0].finish_reason == "abort"
        assert done["a1"].outputs[0].token_ids == expected[1][0]
        assert engine.kv.usage == 0
        with pytest.raises(ConfigError, match="beam_width: beam search is not supported with pipeline"):
            engine.add_request("beam", PROMPTS[0], SamplingParams(beam_width=2, max_tokens=4))
    assert children() == []


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 3},
                                    {"pipeline_parallel_size": 2, "pipeline_layers": [1, 3]},
                                    {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}],
                         ids=["pp3", "pp2_uneven", "pp2xtp2"])
def test_layouts_match_one_process(llama, layout):
    path, expected = llama
    with LLM(str(path), **ENGINE, parallel=layout) as parallel:
        assert_same(expected, run(parallel))
        if "pipeline_layers" in layout:
            assert parallel.engine.kv.spec.num_layers == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_tied", "qwen2_moe", "deepseek_v2", "mamba2", "gemma2"])
@pytest.mark.parametrize("stages", [2, 3])
def test_models_match_one_process(name, stages, tmp_path_factory):
    """Tied embeddings (the last stage loads its own copy), MoE, MLA, Mamba2 (each layer's state
    on its stage) and Gemma 2 (alternating windows read by global layer index)."""
    path = save(tmp_path_factory.getbasetemp(), name)
    with LLM(str(path), **ENGINE) as single:
        expected = run(single, max_tokens=8)
    with LLM(str(path), **ENGINE, **pp(stages)) as parallel:
        assert_same(expected, run(parallel, max_tokens=8))
        if name == "mamba2":
            assert len(parallel.engine.kv.spec.states) == 2  # rank 0 holds 2 of the 4 layers' states


@pytest.mark.slow
def test_preemption_and_contiguous_kv(llama):
    """A pool too small for every sequence (preemption, recompute) and the contiguous cache."""
    path, expected = llama
    # 26 blocks of 4: each of the two micro-batch schedulers may hold 13 (the longest request's 50
    # tokens), and the second one's two requests (40 + 50 tokens) do not fit together
    small = {**ENGINE, "kvcache": {"backend": "paged", "num_blocks": 26, "block_size": 4},
             "scheduler": {**ENGINE["scheduler"], "max_num_seqs": 4}}
    with LLM(str(path), **small, **pp(2)) as parallel:
        assert_same(expected, run(parallel))
        assert sum(s.num_preemptions for s in parallel.engine.virtual.members) > 0
    contiguous = {**ENGINE, "kvcache": "contiguous"}
    with LLM(str(path), **contiguous) as single, LLM(str(path), **contiguous, **pp(2)) as parallel:
        assert_same(run(single), run(parallel))


@pytest.mark.slow
def test_ngram_speculation_and_structured_output(tmp_path_factory):
    """Drafts verified through the pipeline (ngram) and a regex-constrained request: PP=2 == PP=1."""
    from support.hf_models import get_model

    from lmplug.api import StructuredOutput

    path = get_model("llama", tmp_path_factory.getbasetemp(), tokenizer=True).path
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    regex = SamplingParams(temperature=0, max_tokens=6, structured=StructuredOutput(regex="[0-9]{3}"))
    spec = {**ENGINE, "speculative": {"method": "ngram", "num_tokens": 3}}
    results = []
    for layout in ({}, pp(2)):
        with LLM(str(path), **spec, **layout) as llm:
            greedy_ids = llm.generate([prompt], greedy)[0].outputs[0].token_ids
            if layout:
                assert llm.engine.speculator is not None and llm.engine.virtual is None
        with LLM(str(path), **ENGINE, **layout) as llm:  # under PP: micro-batches in flight
            results.append((greedy_ids, llm.generate([prompt, prompt[:5]], regex)[0].outputs[0].text))
    assert results[1] == results[0]
    assert len(results[0][1]) == 3 and results[0][1].isdigit()
    # a separate draft model (the target itself: every draft accepted) on rank 0, verified through the stages
    draft = {**ENGINE, "speculative": {"method": "draft_model", "num_tokens": 3, "model": str(path),
                                         "draft_length": "fixed"}}  # every draft verified, whatever the load
    with LLM(str(path), **draft, **pp(2)) as parallel:
        assert parallel.generate([prompt], greedy)[0].outputs[0].token_ids == results[0][0]
        assert parallel.engine.speculator.num_accepted == parallel.engine.speculator.num_drafted > 0


# -- the demo model --------------------------------------------------------------------------------------

DEMO = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kvcache": "paged", "scheduler": "continuous"}
DEMO_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(DEMO_PROMPTS, params)]


@pytest.mark.slow
def test_demo_gguf_packed_stages_match_one_process(demo_gguf):
    """SmolLM2-135M (30 layers) on the packed GGUF path: each stage keeps its own layers' blocks
    packed (PP=2: 15 + 15, PP=3: 10 x 3) and gives one process's 16 greedy tokens."""
    with LLM(str(demo_gguf), **DEMO) as single:
        expected = _greedy(single)
        whole = single.engine.memory["weight_bytes_per_rank"][0]
    for stages in (2, 3):
        with LLM(str(demo_gguf), **DEMO, **pp(stages)) as parallel:
            assert parallel.engine.resolved.backends["quant"].name == "gguf"
            assert _greedy(parallel) == expected
            per_rank = parallel.engine.memory["weight_bytes_per_rank"]
            # the tied embedding is on the first stage and again on the last; the layers split
            assert max(per_rank) < whole and sum(per_rank) > whole


@pytest.mark.slow
def test_demo_pp2_x_tp3_matches_one_process(demo_gguf):
    """6 processes: 2 stages of 3 tensor-parallel ranks (9 heads / 3 KV heads split by 3), gloo,
    against one process; dense weights on both sides (tensor-parallel ranks slice float tensors)."""
    dense = {**DEMO, "quant": {"method": "gguf", "dequantize_at_load": True}}
    with LLM(str(demo_gguf), **dense) as single:
        expected = _greedy(single)
    with LLM(str(demo_gguf), **dense, **pp(2, 3)) as parallel:
        assert _greedy(parallel) == expected
        mem = parallel.engine.memory
        assert (mem["pipeline_parallel_size"], mem["tensor_parallel_size"]) == (2, 3)
        assert len(mem["weight_bytes_per_rank"]) == 6
    assert children() == []
