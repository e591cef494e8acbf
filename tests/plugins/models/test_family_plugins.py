"""The plugins people run on the native Gemma 2/3, SmolLM3, OLMo 2, Granite and Phi-3: speculative
decoding (ngram: greedy tokens equal to transformers' plain greedy ones, drafts proposed and
accepted), an int8 KV cache (prompt logprobs within int8's tolerance of transformers, the cache
really int8), ``lmplug quantize`` and ``lmplug eval`` (an RTN folder that loads with the native
architecture, its KL to the float model small and positive). One tiny transformers model per
family with a tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from support.gguf_families import FAMILIES, family_configs

pytestmark = pytest.mark.hf

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128}
PAGED = {"kvcache": {"backend": "paged", "block_size": 8}, "attention": {"backend": "paged"}}
# int8 KV (per-vector scales, error <= amax / 254 per element): (max, mean) |prompt logprob diff|
# against transformers; the Llama measurement in test_kv_quant_engine.py leaves ~2x headroom there
INT8_TOL = (0.05, 0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (folder, transformers model), with the tests' tokenizer (512 tokens)."""
    from support.hf_models import VOCAB, write_tokenizer

    from lmplug.testing.architecture import build_tiny

    root, configs, built = tmp_path_factory.mktemp("family_plugins"), family_configs(VOCAB), {}

    def get(name: str):
        if name not in built:
            hf = build_tiny(configs[name], root / name)
            write_tokenizer(root / name)
            built[name] = (root / name, hf)
        return built[name]

    return get


def _native(llm) -> str:
    return llm.engine.parts.plan.architecture.name


@pytest.mark.parametrize("name", FAMILIES)
def test_ngram_speculation_keeps_greedy_tokens(tiny, name):
    from lmplug import LLM, SamplingParams
    from lmplug.testing.architecture import hf_greedy

    path, hf = tiny(name)
    prompts = [[11, 12, 13, 14, 15, 16] * 4, [40, 41, 42, 43] * 5 + [40, 41]]
    llm = LLM(str(path), **ENGINE, **PAGED, speculative={"method": "ngram", "num_tokens": 3, "min_n": 1})
    assert _native(llm) == ("gemma" if name.startswith("gemma") else name)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, 16), f"{name}: speculative greedy tokens differ"
    spec = llm.engine.speculator
    assert spec.num_accepted > 0 and spec.num_drafted > spec.num_accepted  # both verdicts ran


@pytest.mark.parametrize("attention", ["paged", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_int8_kv_cache_stays_close_to_transformers(tiny, name, attention):
    from lmplug import LLM, SamplingParams
    from lmplug.testing.architecture import hf_prompt_logprobs, our_prompt_logprobs, prompt

    path, hf = tiny(name)
    llm = LLM(str(path), **ENGINE, attention={"backend": attention},
              kvcache={"backend": "paged", "block_size": 8, "dtype": "int8"})
    assert llm.engine.kv.spec.kv_dtype == "int8"
    ids = prompt(40, 5, hf.config.vocab_size)
    out = llm.generate([ids], SamplingParams(prompt_logprobs=0, temperature=0, max_tokens=4, ignore_eos=True))[0]
    diff = (our_prompt_logprobs(out, ids) - hf_prompt_logprobs(hf, ids)).abs()
    assert 0 < diff.max() <= INT8_TOL[0], f"{name}: max |diff| {diff.max():.3g}"  # > 0: the int8 cache ran
    assert diff.mean() <= INT8_TOL[1], f"{name}: mean |diff| {diff.mean():.3g}"


def _cli(capsys, *args: Any) -> tuple[int, str, str]:
    from lmplug.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", FAMILIES)
def test_quantize_and_eval(tiny, tmp_path, capsys, name):
    from lmplug import LLM

    path, _ = tiny(name)
    out = tmp_path / "rtn"
    rc, stdout, err = _cli(capsys, "quantize", path, out, "--method", "rtn", "--group-size", "32",
                           "--calib-samples", "4", "--calib-len", "32")
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == json.loads((path / "config.json").read_text())["model_type"]
    assert config["quantization_config"]["quant_method"] == "gptq"
    assert _native(LLM(str(out), **ENGINE)) == ("gemma" if name.startswith("gemma") else name)
    text = tmp_path / "held.txt"
    text.write_text("Some held-out text about the data model and statements. " * 4)
    rc, stdout, err = _cli(capsys, "eval", out, "--text", text, "--reference", path, "--window", "64")
    assert rc == 0, err
    result = json.loads(stdout)
    assert 0 < result["kl"] < 1 and torch.isfinite(torch.tensor(result["perplexity"]))
