"""Parity with HF transformers for tiny random DeepSeek-V2 checkpoints (MLA + DeepSeek MoE).

transformers builds, initialises and saves each model (``DeepseekV2Config``: 2
layers, layer 0 dense, layer 1 routed + shared experts); lmplug loads the folder
and runs it with the `mla` attention backend (`auto` picks it for an MLA model)
over the latent KV layout. Variants: q LoRA, a plain q_proj (V2-Lite), yarn
scaling with mscale (which also changes the softmax scale), and DeepSeek-V3. The greedy reference
is a plain loop over HF's forward with its KV cache.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.moe_models import DEEPSEEK_SPECS as SPECS
from support.moe_models import TinyDeepseek, hf_greedy_loop

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError

pytestmark = pytest.mark.hf

PROMPT_LEN = 24
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    return TinyDeepseek(request.param, tmp_path_factory.mktemp("deepseek"))


def test_config_is_what_the_test_intends(tiny):
    engine = tiny.llm().engine
    assert engine.resolved.backends["attention"].name == "mla"  # auto for an MLA model
    model = engine.parts.model
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "SparseMoeBlock"]
    attn = model.layers[0].self_attn
    assert hasattr(attn, "q_a_proj") == (tiny.name != "no_q_lora")
    mla = engine.parts.model_config.mla
    if tiny.name == "yarn":
        assert tiny.config["rope_parameters"]["rope_type"] == "yarn"
        assert model.rope.cos.abs().max() > 1.01  # yarn's attention factor scales cos/sin
        assert mla.softmax_scale != pytest.approx(24 ** -0.5)  # mscale_all_dim applies
        assert attn.mla.softmax_scale == pytest.approx(tiny.hf.model.layers[0].self_attn.scaling)
    # the cache holds one latent row per token and layer: (32 + 8) fp32 numbers
    assert engine.parts.kv.bytes_per_token == 2 * (32 + 8) * 4


def test_prompt_logprobs_match_hf(tiny):
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    out = tiny.llm().generate([prompt], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, PROMPT_LEN)],
                        dtype=torch.float64)
    ref = hf_logprobs(tiny.hf, prompt)
    ref = torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, PROMPT_LEN)], dtype=torch.float64)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.1  # the prompt was not trivially predictable


@pytest.mark.parametrize("kvcache", ["contiguous", "paged"])
def test_greedy_matches_hf(tiny, kvcache):
    """32 tokens: the prompt through the expanded prefill, then the absorbed decode per token."""
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    overrides = {"kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 64}} \
        if kvcache == "paged" else {"kvcache": "contiguous"}
    out = tiny.llm(**overrides).generate([prompt], params)[0]
    assert out.token_ids == hf_greedy_loop(tiny.hf, prompt, NEW_TOKENS)
    assert len(set(out.token_ids)) > 4  # not a degenerate repetition


def test_batch_matches_alone(tiny):
    """Decodes and prefills of several sequences share a step; results must not mix."""
    if tiny.name != "q_lora":
        pytest.skip("one variant is enough")
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 13, 24)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = tiny.llm()
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


def test_triton_decode_in_the_engine(tiny):
    """The Triton latent decode (interpreted on CPU) inside the engine: the same greedy tokens."""
    if tiny.name != "q_lora":
        pytest.skip("one variant is enough for the interpreted kernel")
    prompt = prompt_ids(12, seed=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    triton = tiny.llm(attention={"backend": "mla", "kernels": "triton"},
                      kvcache={"backend": "paged", "block_size": 4, "num_blocks": 32})
    assert triton.generate([prompt], params)[0].token_ids == tiny.llm().generate([prompt], params)[0].token_ids


def test_attention_backend_must_fit_the_model(tiny, tmp_path):
    if tiny.name != "q_lora":
        pytest.skip("one variant is enough")
    with pytest.raises(ConfigError, match=r"'sdpa'.*deepseek_v2.*mla"):
        LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64, attention="sdpa")


def test_mla_backend_refuses_an_ordinary_model(tmp_path_factory):
    from support.hf_models import get_model

    llama = get_model("llama", tmp_path_factory.mktemp("llama"))
    with pytest.raises(ConfigError, match=r"'mla'.*'llama'.*ordinary attention"):
        LLM(str(llama.path), dtype="float32", device="cpu", max_model_len=64, attention="mla")
