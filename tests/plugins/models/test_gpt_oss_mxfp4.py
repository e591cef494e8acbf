"""A tiny GPT-OSS checkpoint in HF's MXFP4 layout (written here from the published layout: per
layer ``mlp.experts.{gate_up,down}_proj_blocks [E, out, in / 32, 16]`` and ``_scales [E, out, in / 32]``,
``quantization_config.quant_method: mxfp4``), loaded by transformers (which dequantizes it on the
CPU) and by lmplug with the experts packed (native kernel, PyTorch reference) or dequantized at
load: the same logprobs. A blocks tensor of the wrong block count is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmplug.testing.architecture import hf_greedy, hf_prompt_logprobs, our_prompt_logprobs, prompt

pytestmark = [pytest.mark.hf]

CONFIG = {
    "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 256,
    "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
}
QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def write_mxfp4_checkpoint(path: Path, seed: int = 0) -> None:
    """A random transformers GPT-OSS saved, then its experts replaced by random MXFP4 blocks and
    scales (scales around 2^-4: weights of a size the model stays sane with)."""
    from safetensors.torch import load_file, save_file

    from lmplug.testing.architecture import build_tiny

    build_tiny(CONFIG, path, seed)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    experts, hidden, inter = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            del tensors[f"{prefix}.{proj}"]
            tensors[f"{prefix}.{proj}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16),
                                                               dtype=torch.uint8, generator=g)
            tensors[f"{prefix}.{proj}_scales"] = torch.randint(121, 126, (experts, rows, cols // 32),
                                                               dtype=torch.uint8, generator=g)
            tensors[f"{prefix}.{proj}_bias"] = 0.2 * torch.randn(tensors[f"{prefix}.{proj}_bias"].shape, generator=g)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = QUANT
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """(folder, transformers' model of it, dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              quantization_config=Mxfp4Config(dequantize=True))
    return path, hf.eval()


def _llm(path, **options):
    from lmplug import LLM

    return LLM(str(path), dtype="float32", device="cpu", max_model_len=128, attention={"backend": "sdpa"},
               **options)


@pytest.mark.parametrize("quant", [None, {"method": "mxfp4", "kernel": "torch"},
                                   {"method": "mxfp4", "dequantize_at_load": True}],
                         ids=["packed-auto", "packed-torch", "dequantized-at-load"])
def test_mxfp4_checkpoint_matches_transformers(mxfp4_model, quant):
    from lmplug import SamplingParams

    path, hf = mxfp4_model
    llm = _llm(path, **({"quant": quant} if quant else {}))
    expert = llm.engine.runner.model.layers[0].mlp.gate_up_proj[0]
    packed = "blocks" in dict(expert.named_parameters())
    assert packed == (quant is None or not quant.get("dequantize_at_load"))
    ids = prompt(24, 1, 96)
    out = llm.generate([ids], SamplingParams(prompt_logprobs=0, temperature=0, max_tokens=16, ignore_eos=True))[0]
    torch.testing.assert_close(our_prompt_logprobs(out, ids), hf_prompt_logprobs(hf, ids), atol=1e-4, rtol=0)
    assert out.token_ids == hf_greedy(hf, ids, 16)


def test_an_mxfp4_tensor_with_the_wrong_block_count_is_named(mxfp4_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from lmplug.errors import ModelLoadError

    path, _ = mxfp4_model
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_bytes((path / name).read_bytes())
    tensors = load_file(path / "model.safetensors")
    bad = "model.layers.1.mlp.experts.down_proj_blocks"
    tensors[bad] = tensors[bad][:, :, :1].contiguous()  # 1 block a row where 2 cover the 64 input features
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as err:
        _llm(tmp_path)
    assert bad in str(err.value) and "1 blocks a row where 2 cover the 64 input features" in str(err.value)


@pytest.mark.slow
def test_mxfp4_experts_split_under_tensor_parallelism(mxfp4_model):
    """TP=2: each rank reads its rows of gate/up and its whole blocks of down's inputs (32 of 64)."""
    from lmplug import SamplingParams

    path, hf = mxfp4_model
    ids = prompt(24, 7, 96)
    llm = _llm(path, parallel={"tensor_parallel_size": 2})
    try:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    finally:
        llm.close()
    assert out.token_ids == hf_greedy(hf, ids, 16)


def test_mxfp4_on_a_float_checkpoint_is_refused_by_name(tmp_path):
    from lmplug.errors import ModelLoadError
    from lmplug.testing.architecture import build_tiny

    build_tiny(CONFIG, tmp_path)
    with pytest.raises(ModelLoadError, match=r"experts\.(gate_up|down)_proj' holds float experts, but quant method 'mxfp4'"):
        _llm(tmp_path, quant={"method": "mxfp4"})
