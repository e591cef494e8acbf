"""The plugins people run on the native Gemma 2/3, SmolLM3, OLMo 2, Granite and Phi-3: speculative
decoding (ngram: greedy tokens equal to transformers' plain greedy ones, drafts proposed and
verified), an int8 KV cache (the same prompt logprobs as transformers' model code, the fallback,
over the same int8 cache), ``lmplug quantize`` and ``lmplug eval`` (an RTN folder that loads with the native
architecture, its KL to the float model small and positive). One tiny transformers model per
family with a tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from support.cli_eval import assert_eval_close, cli
from support.gguf_families import FAMILIES, family_configs

pytestmark = pytest.mark.hf

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128}
PAGED = {"kvcache": {"backend": "paged", "block_size": 8}, "attention": {"backend": "paged"}}
# native vs the transformers fallback over the same int8 cache: equal quantization inputs up to
# float rounding, so up to an int8 step flipped here and there (measured: equal to 1e-4)
INT8_ATOL = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (folder, transformers model), with the tests' tokenizer (512 tokens)."""
    from support.hf_models import VOCAB, write_tokenizer

    from lmplug.testing.architecture import build_tiny

    root, configs, built = tmp_path_factory.mktemp("family_plugins"), family_configs(VOCAB), {}
    # no GGUF here: Gemma 3's windows listed over 3 layers (its 5:1 default needs 7)
    configs["gemma3"] = {**configs["gemma3"], "num_hidden_layers": 3,
                         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}

    def get(name: str):
        if name not in built:
            hf = build_tiny(configs[name], root / name)
            write_tokenizer(root / name)
            built[name] = (root / name, hf)
        return built[name]

    return get


def _native(llm) -> str:
    return llm.engine.parts.plan.architecture.name


def _native_name(family: str) -> str:
    return "gemma" if family.startswith("gemma") else family


@pytest.mark.parametrize("name", FAMILIES)
def test_ngram_speculation_keeps_greedy_tokens(tiny, name):
    from lmplug import LLM, SamplingParams
    from lmplug.testing.architecture import hf_greedy

    path, hf = tiny(name)
    prompts = [[11, 12, 13, 14, 15, 16] * 4, [40, 41, 42, 43] * 5 + [40, 41]]
    llm = LLM(str(path), **ENGINE, **PAGED, speculative={"method": "ngram", "num_tokens": 3, "min_n": 1,
                                                          "draft_length": "fixed"})
    assert _native(llm) == _native_name(name)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, 16), f"{name}: speculative greedy tokens differ"
    assert llm.engine.speculator.num_drafted > 0  # drafts were verified (accepted ones: model-dependent)


@pytest.mark.parametrize("attention", ["paged", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_int8_kv_cache_matches_the_transformers_fallback(tiny, name, attention):
    """The int8 cache's error depends on the model (measured against transformers' float run:
    max |prompt logprob diff| 0.019 Phi-3 .. 0.27 Gemma 3, whose q/k norms sharpen the scores);
    the native architecture must make the same error as transformers' own model code over the
    same int8 cache (the fallback), and a nonzero one (the cache really int8)."""
    from lmplug import LLM, SamplingParams
    from lmplug.testing.architecture import hf_prompt_logprobs, our_prompt_logprobs, prompt

    path, hf = tiny(name)
    ids = prompt(40, 5, hf.config.vocab_size)
    runs, archs = {}, {}
    for impl in ("native", "transformers"):
        llm = LLM(str(path), **ENGINE, model_impl=impl, attention={"backend": attention},
                  kvcache={"backend": "paged", "block_size": 8, "dtype": "int8"})
        assert llm.engine.kv.spec.kv_dtype == "int8"
        archs[impl] = _native(llm)
        out = llm.generate([ids], SamplingParams(prompt_logprobs=0, temperature=0, max_tokens=4, ignore_eos=True))
        runs[impl] = our_prompt_logprobs(out[0], ids)
    assert archs == {"native": _native_name(name), "transformers": "transformers"}
    assert (runs["native"] - hf_prompt_logprobs(hf, ids)).abs().max() > 0
    torch.testing.assert_close(runs["native"], runs["transformers"], atol=INT8_ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_quantize_and_eval(tiny, tmp_path, capsys, name):
    from lmplug import LLM

    path, _ = tiny(name)
    out = tmp_path / "rtn"
    rc, _, err = cli(capsys, "quantize", path, out, "--method", "rtn", "--group-size", "32",
                     "--calib-samples", "4", "--calib-len", "32")
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == json.loads((path / "config.json").read_text())["model_type"]
    assert config["quantization_config"]["quant_method"] == "gptq"
    assert _native(LLM(str(out), **ENGINE)) == _native_name(name)
    assert_eval_close(capsys, out, path, tmp_path)
