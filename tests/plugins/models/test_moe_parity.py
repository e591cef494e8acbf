"""Parity with HF transformers for tiny random Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints.

transformers builds, initialises and saves each model (per-expert tensors, as
real checkpoints store them); lmplug loads the folder, stacks the experts and
routes through the moe backend `auto` picks on CPU (`reference`). Each model is
also saved the transformers-5 way (``save_original_format=False``: one
``experts.gate_up_proj [E, 2I, h]`` and ``experts.down_proj [E, h, I]`` per layer),
which must load to the same results (DeepSeek-V3 too). The greedy
reference is a plain loop over HF's forward with its KV cache, so nothing in
HF's generation code (EOS handling, logits processors) stands between us.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.moe_models import MOE_SPECS, TinyDeepseek, TinyMoE, hf_greedy_loop, save_stacked

from lmplug import LLM, SamplingParams

pytestmark = pytest.mark.hf

PROMPT_LEN = 24
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=list(MOE_SPECS))
def tiny(request, tmp_path_factory):
    return TinyMoE(request.param, tmp_path_factory.mktemp("moe"))


def test_config_is_what_the_test_intends(tiny):
    layers = tiny.hf.model.layers
    assert tiny.llm().engine.resolved.backends["moe"].name == "reference"  # auto, no moe section
    if tiny.name == "qwen2_moe":
        assert hasattr(layers[0].mlp, "shared_expert_gate") and not hasattr(layers[1].mlp, "experts")
        assert not tiny.config["norm_topk_prob"]
    if tiny.name == "qwen3_moe":
        assert hasattr(layers[0].self_attn, "q_norm") and tiny.config["norm_topk_prob"]
    model = tiny.llm().engine.parts.model
    sparse = [type(layer.mlp).__name__ for layer in model.layers]
    assert sparse == (["SparseMoeBlock", "MLP"] if tiny.name == "qwen2_moe" else ["SparseMoeBlock"] * 2)


def test_prompt_logprobs_match_hf(tiny):
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    out = tiny.llm().generate([prompt], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, PROMPT_LEN)],
                        dtype=torch.float64)
    ref = hf_logprobs(tiny.hf, prompt)
    ref = torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, PROMPT_LEN)], dtype=torch.float64)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.1  # the prompt was not trivially predictable


def test_greedy_matches_hf(tiny):
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    out = tiny.llm().generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                       ignore_eos=True))[0]
    assert out.token_ids == hf_greedy_loop(tiny.hf, prompt, NEW_TOKENS)


def test_batch_matches_alone(tiny):
    """Tokens of different sequences share the experts' grouped matmuls; results must not mix."""
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 13, 24)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = tiny.llm()
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


def test_fused_backend_generates_the_same_tokens(tiny):
    """The Triton experts (interpreted on CPU) inside the engine: same greedy tokens as reference."""
    if tiny.name != "mixtral":
        pytest.skip("one model is enough for the interpreted kernels")
    prompt = prompt_ids(12, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fused = tiny.llm(moe="fused")
    assert fused.engine.resolved.backends["moe"].name == "fused"
    assert fused.generate([prompt], params)[0].token_ids == tiny.llm().generate([prompt], params)[0].token_ids


def test_stacked_v5_checkpoint_matches_hf(tiny):
    """transformers 5's stacked ``experts.gate_up_proj`` / ``experts.down_proj`` load as the
    per-expert tensors do: same prompt logprobs as HF, same 32 greedy tokens."""
    llm = tiny.stacked_llm()
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, PROMPT_LEN)],
                        dtype=torch.float64)
    ref = hf_logprobs(tiny.hf, prompt)
    ref = torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, PROMPT_LEN)], dtype=torch.float64)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy_loop(tiny.hf, prompt, NEW_TOKENS)
    ours_w = llm.engine.parts.model.layers[0].mlp.experts.w_gate_up
    legacy_w = tiny.llm().engine.parts.model.layers[0].mlp.experts.w_gate_up
    assert torch.equal(ours_w, legacy_w)  # both forms fill the same stacked parameter


def test_stacked_v5_deepseek_v3_matches_hf(tmp_path):
    tiny = TinyDeepseek("v3", tmp_path)
    llm = LLM(str(save_stacked(tiny.hf, tmp_path / "v3_v5")), dtype="float32", device="cpu", max_model_len=256)
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy_loop(tiny.hf, prompt, NEW_TOKENS)


def test_stacked_v5_wrong_layout_is_named(tmp_path):
    """A stacked gate_up_proj stored [E, h, 2I] (transposed) is refused, naming tensor and layout."""
    from safetensors.torch import load_file, save_file

    from lmplug import ModelLoadError

    path = save_stacked(TinyMoE("qwen3_moe", tmp_path).hf, tmp_path / "bad")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj.*\(8, 64, 96\).*"
                                             r"\(8, 96, 64\).*gate rows, then up"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
