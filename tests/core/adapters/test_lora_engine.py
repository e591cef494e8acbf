"""LoRA adapters with the engine's other features: prefix caching (never shared across adapters),
chunked prefill and preemption, ngram speculative decoding (drafts verified with the adapter),
structured output. The reference is PEFT's model greedy, as in ``test_lora_parity``."""

from __future__ import annotations

import pytest
from support.hf_models import get_model, hf_greedy, one_torch_thread, prompt_ids  # noqa: F401
from support.lora_adapters import make_adapter

from lmplug import LLM, LoRARequest, SamplingParams
from lmplug.interfaces.constraint import StructuredOutput

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    tiny = get_model("llama", root, tokenizer=True)
    out = []
    for k, rank in enumerate((4, 8)):
        peft = make_adapter(tiny.hf, root / f"a{k}", rank=rank, seed=30 + k)
        out.append((LoRARequest(f"a{k}", k + 1, str(root / f"a{k}")), peft.get_base_model()))
    return tiny, out


def _llm(tiny, **overrides):
    return LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=128,
               lora={"max_loras": 2, "max_lora_rank": 8}, **overrides)


def test_prefix_cache_never_shares_blocks_across_adapters(setup):
    tiny, adapters = setup
    llm = _llm(tiny, kvcache={"backend": "paged", "block_size": 4, "prefix_caching": True})
    hits: list[int] = []
    allocate = llm.engine.kv.allocate

    def recording(seq, num_tokens):
        cached = allocate(seq, num_tokens)
        if seq.num_computed_tokens == 0:
            hits.append(cached)
        return cached

    llm.engine.kv.allocate = recording
    try:
        prompt = prompt_ids(21, seed=3)
        (a0, hf0), (a1, hf1) = adapters
        seen: set = set()
        # the second run under each adapter (and the base) hits its prefix; no other run does
        for lora, hf in [(a0, hf0), (a0, hf0), (a1, hf1), (None, tiny.hf), (a1, hf1), (None, tiny.hf)]:
            hits.clear()
            out = llm.generate([prompt], GREEDY, lora=lora)[0]
            assert out.token_ids == hf_greedy(hf, prompt, NEW)
            key = None if lora is None else lora.lora_name
            assert (hits[0] > 0) == (key in seen), f"adapter {key}: {hits[0]} cached tokens"
            seen.add(key)
    finally:
        llm.close()


def test_chunked_prefill_and_preemption(setup):
    tiny, adapters = setup
    # 8-token chunks; 12 blocks of 4 tokens for four 30-token sequences: some are preempted
    llm = _llm(tiny, scheduler={"backend": "continuous", "max_num_batched_tokens": 8, "max_num_seqs": 4},
               kvcache={"backend": "paged", "block_size": 4, "num_blocks": 24})
    try:
        prompts = [prompt_ids(22, seed=60 + k) for k in range(4)]
        loras = [adapters[0][0], adapters[1][0], None, adapters[0][0]]
        refs = [adapters[0][1], adapters[1][1], tiny.hf, adapters[0][1]]
        outs = llm.generate(prompts, GREEDY, lora=loras)
        for out, p, hf in zip(outs, prompts, refs):
            assert out.token_ids == hf_greedy(hf, p, NEW)
    finally:
        llm.close()


def test_ngram_drafts_are_verified_with_the_adapter(setup):
    tiny, adapters = setup
    # every proposed draft verified: `cost` (the default) may find no draft worth its verify on a
    # loaded machine, and then nothing is verified with the adapter
    llm = _llm(tiny, speculative={"method": "ngram", "num_tokens": 3, "min_n": 1, "max_n": 2,
                                  "draft_length": "fixed"})
    try:
        prompt = prompt_ids(6, seed=7) * 4  # repeats: the ngram drafter finds matches
        for lora, hf in adapters:
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                               lora=lora)[0]
            assert out.token_ids == hf_greedy(hf, prompt, 16)
            assert out.metrics.num_drafted_tokens > 0
    finally:
        llm.close()


def test_structured_output_with_an_adapter(setup):
    tiny, adapters = setup
    llm = _llm(tiny)
    try:
        choices = ["alpha beta", "gamma", "delta epsilon zeta"]
        params = SamplingParams(temperature=0, max_tokens=24, structured=StructuredOutput(choice=choices))
        outs = llm.generate(["pick one"] * 3, params, lora=[adapters[0][0], adapters[1][0], None])
        assert all(out.text in choices for out in outs), [o.text for o in outs]
    finally:
        llm.close()
