"""KV-cache quantization (kvcache ``dtype: int8 | fp8_e4m3``) in the engine: the tiny HF Llama,
paged int8 / fp8, gives prompt logprobs within a stated tolerance of the unquantized engine;
prefix caching, copy-on-write forks, speculative rollback and the sliding-window ring keep
working. Storage, attention backends and config: test_kv_quant.py.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture

from lmplug import SamplingParams
from lmplug.errors import ConfigError
from lmplug.interfaces.kvcache import KV_CACHE_DTYPES

KV_DTYPES = list(KV_CACHE_DTYPES)  # int8, fp8_e4m3


# -- engine ---------------------------------------------------------------------------------------

# (max, mean) |prompt logprob diff| vs the unquantized engine on the tiny random Llama (random
# norm weights make its K/V outlier-heavy, the hard case for per-vector scales). int8 errors are
# <= amax/254 per element, e4m3 <= 2^-4 relative, so e4m3 moves logits ~4-5x more. Measured
# (2 layers, 3 prompts, 106 positions): int8 max 0.022 mean 0.0047, e4m3 max 0.092 mean 0.022;
# the tolerances leave ~2x headroom.
LOGPROB_TOL = {"int8": (0.05, 0.01), "fp8_e4m3": (0.2, 0.05)}
PAGED = {"backend": "paged", "block_size": 8, "num_blocks": 128}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("kvq"))


def prompt_logprobs(llm, prompts: list[list[int]], max_tokens: int = 16):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    lps = [torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
           for o, p in zip(outs, prompts)]
    return torch.cat(lps), [o.outputs[0].token_ids for o in outs]


PROMPTS = [prompt_ids(37, 1), prompt_ids(12, 2), prompt_ids(60, 3)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("attention", ["paged", "sdpa"])
def test_engine_prompt_logprobs_close_to_unquantized(llama, kv_dtype, attention, capsys):
    base, base_tokens = prompt_logprobs(llama.llm(kvcache=PAGED, attention=attention), PROMPTS)
    llm = llama.llm(kvcache={**PAGED, "dtype": kv_dtype}, attention=attention)
    assert llm.engine.kv.spec.kv_dtype == kv_dtype
    lp, tokens = prompt_logprobs(llm, PROMPTS)
    diff = (lp - base).abs()
    agree = sum(a == b for x, y in zip(tokens, base_tokens) for a, b in zip(x, y))
    with capsys.disabled():
        print(f"\n[{kv_dtype}/{attention}] prompt logprob |diff| max {diff.max():.2e} mean {diff.mean():.2e}; "
              f"greedy tokens equal {agree}/{sum(map(len, tokens))}")
    assert 0 < diff.max() <= LOGPROB_TOL[kv_dtype][0]
    assert diff.mean() <= LOGPROB_TOL[kv_dtype][1]


def assert_close_logprobs(lp: torch.Tensor, base: torch.Tensor, kv_dtype: str) -> None:
    diff = (lp - base).abs()
    assert 0 < diff.max() <= LOGPROB_TOL[kv_dtype][0]  # > 0: the quantized path ran
    assert diff.mean() <= LOGPROB_TOL[kv_dtype][1]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_contiguous_cache_in_the_engine(llama, kv_dtype):
    base, _ = prompt_logprobs(llama.llm(kvcache="contiguous"), PROMPTS[:2], max_tokens=4)
    lp, _ = prompt_logprobs(llama.llm(kvcache={"backend": "contiguous", "dtype": kv_dtype}), PROMPTS[:2],
                            max_tokens=4)
    assert_close_logprobs(lp, base, kv_dtype)


def test_flash_in_the_engine(llama):
    """flash (interpreted) over a quantized paged cache. A fresh prompt's prefill attends over the
    step's own K/V, so its prompt logprobs are exactly the unquantized ones; decode reads the
    quantized cache, as paged attention does."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    runs = [llama.llm(kvcache={**PAGED, "dtype": d}, attention=a).generate(PROMPTS[:2], params)
            for d, a in (("auto", "flash"), ("int8", "flash"), ("int8", "paged"))]

    def prompt_lps(out) -> list[float]:
        return [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]

    for base, flash, paged in zip(*runs):
        assert prompt_lps(flash) == prompt_lps(base)
        tokens = flash.outputs[0].token_ids
        assert tokens == paged.outputs[0].token_ids
        diffs = [abs(a[t].logprob - b[t].logprob)
                 for a, b, t in zip(flash.outputs[0].logprobs, paged.outputs[0].logprobs, tokens)]
        assert max(diffs) <= LOGPROB_TOL["int8"][0]


def test_prefix_cache_hit_reads_the_cached_quantized_blocks(llama):
    """A prompt whose first blocks come from the prefix cache (quantized K/V and scales written
    by an earlier request) decodes as the same prompt computed from scratch."""
    kv = {**PAGED, "dtype": "int8"}
    prompt = prompt_ids(40, 7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    plain = llama.llm(kvcache=kv).generate([prompt + [5, 6, 7]], params)[0].outputs[0]
    engine = llama.llm(kvcache={**kv, "prefix_caching": True}).engine
    outs, computed = {}, {}
    for rid, p in (("fill", prompt), ("hit", prompt + [5, 6, 7])):
        engine.add_request(rid, p, params)
        engine.step()
        computed[rid] = engine.last_stats["num_prefill_tokens"]
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o.outputs[0]
    assert computed == {"fill": 40, "hit": 3}  # the hit read five full blocks from the cache
    assert outs["hit"].token_ids == plain.token_ids
    got = [lp[t].logprob for lp, t in zip(outs["hit"].logprobs, plain.token_ids)]
    want = [lp[t].logprob for lp, t in zip(plain.logprobs, plain.token_ids)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-3, rtol=0)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_forked_samples_see_the_copied_blocks(llama, kv_dtype):
    """n = 3 greedy samples fork the prompt's blocks; each sibling's copy-on-write copy of the
    last shared block must carry its scales, or the siblings would diverge from n = 1."""
    llm = llama.llm(kvcache={**PAGED, "dtype": kv_dtype, "block_size": 16})
    prompt = prompt_ids(21, 4)  # the last block is half full: siblings write into copies
    one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    three = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3))[0]
    assert [c.token_ids for c in three.outputs] == [one.outputs[0].token_ids] * 3


def test_speculative_rollback_with_quantized_kv(tmp_path_factory):
    from support.spec_helpers import REFERENCE, make_engine, run

    model = get_model("llama", tmp_path_factory.mktemp("spec"), tokenizer=True)
    kv = {"backend": "paged", "block_size": 4, "num_blocks": 200, "dtype": "int8", "prefix_caching": True}
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [prompt_ids(11, 3), prompt_ids(25, 5)]
    reference = run(make_engine(model.path, kvcache=kv), prompts, greedy)
    for prompt, out in zip(prompts, reference):
        REFERENCE[tuple(prompt)] = out.token_ids
    engine = make_engine(model.path, {"method": "test_oracle", "num_tokens": 3, "wrong_every": 3}, kvcache=kv)
    outs = run(engine, prompts, greedy)
    assert engine.speculator.num_accepted < engine.speculator.num_drafted  # some drafts were rolled back
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert engine.kv.usage == 0


@pytest.mark.parametrize("kvcache", ["contiguous", "paged"])
def test_sliding_window_with_quantized_kv(tmp_path_factory, kvcache):
    """The tiny Mistral (window 16) past its window: the ring buffer / released blocks hold
    quantized K/V and scales, and logprobs stay within the int8 tolerance."""
    mistral = get_model("mistral", tmp_path_factory.mktemp("swa"))
    kv = {"backend": kvcache, **({"block_size": 4, "num_blocks": 64} if kvcache == "paged" else {})}
    sched = {"backend": "continuous", "max_num_batched_tokens": 8}
    prompts = [list(range(3, 27))]  # longer than the window, prefilled in chunks of 8
    base, base_tokens = prompt_logprobs(mistral.llm(kvcache=kv, scheduler=sched), prompts, max_tokens=30)
    llm = mistral.llm(kvcache={**kv, "dtype": "int8"}, scheduler=sched)
    lp, tokens = prompt_logprobs(llm, prompts, max_tokens=30)
    if kvcache == "contiguous":
        assert llm.engine.kv.layer_view(0).k_scale.shape[1] == 16 + 8 - 1  # the ring
    assert_close_logprobs(lp, base, "int8")
    assert sum(a == b for a, b in zip(tokens[0], base_tokens[0])) >= 24


def test_mla_model_refuses_quantized_kv(tmp_path_factory):
    """`attention: auto` on an MLA model becomes `mla`, which reads the model dtype only: the
    build refuses the quantized cache, naming the option and the backend."""
    from support.moe_models import TinyDeepseek

    tiny = TinyDeepseek("no_q_lora", tmp_path_factory.mktemp("mla"))
    with pytest.raises(ConfigError, match=r"kvcache.dtype='int8' is not read by attention backend 'mla'"):
        tiny.llm(kvcache={"backend": "paged", "dtype": "int8", "num_blocks": 16})
