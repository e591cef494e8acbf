"""The paged KV cache in the engine: same tokens as the contiguous cache, prefix caching,
copy-on-write for ``n > 1``, and blocks returned when requests finish."""

from __future__ import annotations

import logging

import pytest
import torch

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def llm(path: str, **kvcache) -> LLM:
    if not kvcache:
        return LLM(path, device="cpu", dtype="float32", max_model_len=256)
    attention = kvcache.pop("attention", "auto")
    return LLM(path, device="cpu", dtype="float32", max_model_len=256, attention=attention,
               kvcache={"backend": "paged", "block_size": 16, "num_blocks": 64, **kvcache})


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def contiguous(tiny_llama):
    return llm(tiny_llama)


def test_auto_attention_follows_the_kv_layout(tiny_llama, contiguous):
    assert contiguous.engine.resolved.backends["attention"].name == "sdpa"
    assert llm(tiny_llama).engine.resolved.backends["kvcache"].name == "contiguous"
    paged = llm(tiny_llama, block_size=16)
    assert paged.engine.resolved.backends["attention"].name == "paged"
    assert paged.engine.kv.num_blocks == 64


@pytest.mark.parametrize("kv", [
    {"block_size": 16}, {"block_size": 4, "num_blocks": 256}, {"block_size": 32, "prefix_caching": True},
    {"block_size": 16, "attention": "sdpa"},
], ids=["bs16", "bs4", "bs32-prefix", "sdpa-reads-paged"])
def test_greedy_tokens_equal_contiguous(tiny_llama, contiguous, kv):
    batch = prompts(5, 17, 40, 33, 64)
    expected = tokens(contiguous.generate(batch, GREEDY))
    paged = llm(tiny_llama, **kv)
    assert tokens(paged.generate(batch, GREEDY)) == expected
    assert paged.engine.kv.usage == 0  # every block returned


def test_triton_kernels_in_the_engine(tiny_llama, contiguous):
    """The Triton kernels (interpreted) drive a whole generation: write, prefill, decode."""
    batch = prompts(9, 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    paged = llm(tiny_llama, block_size=8, attention={"backend": "paged", "kernels": "triton"})
    assert tokens(paged.generate(batch, params)) == tokens(contiguous.generate(batch, params))


def _prefill_tokens(engine, request_id: str, prompt: list[int]) -> tuple[int, list[int]]:
    """Run one request alone; return the tokens its first step computed, and its output."""
    engine.add_request(request_id, prompt, GREEDY)
    engine.step()
    computed = engine.last_stats["num_prefill_tokens"]
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return computed, out.outputs[0].token_ids


def test_prefix_cache_computes_only_the_new_tokens(tiny_llama, contiguous):
    prefix = prompts(40, seed=7)[0]
    first, second = prefix + prompts(10, seed=8)[0], prefix + prompts(7, seed=9)[0]
    paged = llm(tiny_llama, block_size=16, prefix_caching=True)
    engine = paged.engine
    computed, out1 = _prefill_tokens(engine, "a", first)
    assert computed == len(first)
    computed, out2 = _prefill_tokens(engine, "b", second)
    assert computed == len(second) - 32  # the two full blocks of the shared 40 tokens were reused
    assert [out1, out2] == tokens(contiguous.generate([first, second], GREEDY))
    # the same prompt again: every full block but the one holding the last token is reused
    computed, out3 = _prefill_tokens(engine, "c", second)
    assert computed == len(second) - 32 and out3 == out2
    assert engine.kv.usage == 0 and engine.kv.blocks.cached_block_ids  # unreferenced, still cached


def test_n_samples_share_the_prompt_blocks(tiny_llama):
    prompt = prompts(40, seed=11)[0]  # 2 full blocks + a partial one
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=3, seed=5)
    paged = llm(tiny_llama, block_size=16)
    engine = paged.engine
    engine.add_request("n3", prompt, params)
    engine.step()  # prefill of the first sequence, then the siblings fork from it
    req = engine.requests["n3"]
    tables = [engine.kv.block_table(s) for s in req.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert engine.kv.blocks.num_used_blocks == 3  # one copy of the prompt, not three
    engine.step()  # each writes its first token: the shared partial block is copied, twice
    tables = [engine.kv.block_table(s) for s in req.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert engine.kv.blocks.num_used_blocks == 5  # 2 shared + 3 own (9 without sharing)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    samples = [c.token_ids for c in out.outputs]
    assert len(set(map(tuple, samples))) > 1
    assert engine.kv.usage == 0
    for i, sample in enumerate(samples):  # sequence i is seeded with seed + i
        alone = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5 + i)
        assert paged.generate(prompt, alone)[0].outputs[0].token_ids == sample


def test_n_samples_equal_the_contiguous_engine(tiny_llama, contiguous):
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, n=3, seed=2)
    batch = prompts(16, 23)
    expected = [[c.token_ids for c in o.outputs] for o in contiguous.generate(batch, params)]
    paged = llm(tiny_llama, block_size=16)
    assert [[c.token_ids for c in o.outputs] for o in paged.generate(batch, params)] == expected
    one_token = SamplingParams(temperature=0.8, max_tokens=1, n=3, seed=2)  # siblings finish at once
    paged.generate(batch, one_token)
    assert paged.engine.kv.usage == 0


def test_pool_sizing_and_startup_log(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="lmplug_kvcache.paged"):
        paged = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=256,
                    kvcache={"backend": "paged", "block_size": 16, "memory_gb": 0.001})
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert paged.engine.kv.num_blocks == int(0.001 * 2**30) // (16 * bytes_per_token)
    assert f"{bytes_per_token} bytes/token" in caplog.text and "blocks of 16 tokens" in caplog.text
    default = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=256, kvcache="paged")
    # the CPU default never exceeds max_num_seqs x max_model_len tokens
    assert default.engine.kv.num_tokens <= 8 * 256


def test_bad_options_name_the_option(tiny_llama):
    with pytest.raises(ConfigError, match="block_size.*power of two"):
        llm(tiny_llama, block_size=24)
    with pytest.raises(ConfigError, match="kvcache.prefix_cache: unknown option"):
        llm(tiny_llama, prefix_cache=True)
    with pytest.raises(ConfigError, match="less than one block"):
        LLM(tiny_llama, device="cpu", max_model_len=256, kvcache={"backend": "paged", "memory_gb": 1e-9})


@pytest.mark.hf
@pytest.mark.parametrize("arch", ["llama3_rope", "mistral", "qwen2", "qwen3"])
def test_hf_parity_models_equal_contiguous(arch, tmp_path_factory):
    """GQA, RoPE scaling, a sliding window shorter than the context (mistral), biases, q/k-norm."""
    from support.hf_models import get_model, prompt_ids

    tiny = get_model(arch, tmp_path_factory.mktemp(arch))
    batch = [prompt_ids(n, seed=n) for n in (6, 24, 37)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = tokens(tiny.llm().generate(batch, params))
    for kv in ({"block_size": 8}, {"block_size": 16, "prefix_caching": True}):
        paged = tiny.llm(kvcache={"backend": "paged", "num_blocks": 64, **kv})
        assert tokens(paged.generate(batch, params)) == expected
        assert tokens(paged.generate(batch, params)) == expected  # again: prefix hits when caching


def test_cpu_pool_in_huge_pages_gives_the_same_tokens(tiny_llama, monkeypatch):
    """On the CPU the pool is cut from huge-page memory (``lmplug.kit.hugemem``), zeroed, and
    decoding over it gives the tokens it gives in torch's memory (``LMPLUG_HUGE_PAGES=0``)."""
    from lmplug.kit import hugemem

    monkeypatch.delenv("LMPLUG_HUGE_PAGES", raising=False)
    if not hugemem.enabled():
        pytest.skip("no huge-page memory here (not Linux)")
    batch = prompts(5, 40, 17)
    huge = llm(tiny_llama, block_size=16)
    pool = huge.engine.kv._pool
    assert pool.data_ptr() % hugemem.ALIGN == 0 and not bool(pool.any())
    assert pool.untyped_storage().nbytes() > pool.numel() * pool.element_size()  # a piece of an arena
    got = tokens(huge.generate(batch, GREEDY))
    monkeypatch.setenv("LMPLUG_HUGE_PAGES", "0")
    plain = llm(tiny_llama, block_size=16)
    assert plain.engine.kv._pool.untyped_storage().nbytes() == plain.engine.kv._pool.numel() * 4
    assert not bool(plain.engine.kv._pool.any())  # zeroed
    assert got == tokens(plain.generate(batch, GREEDY))
