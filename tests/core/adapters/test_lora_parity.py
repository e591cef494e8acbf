"""LoRA adapters in the engine against PEFT: the ``PeftModel`` and the merged model.

Tiny random llama / qwen2 (q/k/v biases) / qwen3 (q/k norms) models, random PEFT adapters of
ranks 4, 8 and 16 (one on the attention only, one with rsLoRA), fp32 prompt logprobs within
1e-4 of both references and greedy tokens equal; a batch mixing three adapters and the base
equals each request alone, also when the slots hold fewer adapters than the batch asks for.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import get_model, hf_greedy, hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.lora_adapters import ATTENTION, make_adapter, merged

from lmplug import LLM, LoRARequest, SamplingParams

PROMPT_LEN, NEW_TOKENS = 20, 8
# (rank, targets, rslora)
ADAPTERS = [(4, None, False), (8, ATTENTION, False), (16, None, True)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    tiny = get_model(request.param, root)
    adapters = []
    for k, (rank, targets, rslora) in enumerate(ADAPTERS):
        path = root / f"{request.param}-a{k}"
        peft = make_adapter(tiny.hf, path, rank=rank, seed=10 + k, targets=targets, rslora=rslora)
        adapters.append((LoRARequest(f"a{k}", k + 1, str(path)), peft))
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=128,
              lora={"max_loras": 4, "max_lora_rank": 16})
    yield tiny, adapters, llm
    llm.close()


def _prompt_lp(out, prompt: list[int]) -> torch.Tensor:
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


def _ref_lp(model, prompt: list[int]) -> torch.Tensor:
    lp = hf_logprobs(model, prompt)
    return torch.stack([lp[i - 1, prompt[i]] for i in range(1, len(prompt))])


@pytest.mark.parametrize("which", range(len(ADAPTERS)))
def test_prompt_logprobs_match_peft_and_merged(setup, which):
    tiny, adapters, llm = setup
    lora, peft = adapters[which]
    prompt = prompt_ids(PROMPT_LEN, seed=which)
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=0, max_tokens=1), lora=lora)[0]
    ours = _prompt_lp(out, prompt)
    ref = _ref_lp(peft, prompt)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, _ref_lp(merged(peft), prompt), atol=1e-4, rtol=0)
    # the adapter changes the model (else matching the base would pass too)
    assert (ref - _ref_lp(tiny.hf, prompt)).abs().max() > 1e-2


@pytest.mark.parametrize("which", range(len(ADAPTERS)))
def test_greedy_matches_peft(setup, which):
    _, adapters, llm = setup
    lora, peft = adapters[which]
    prompt = prompt_ids(PROMPT_LEN, seed=20 + which)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       lora=lora)[0]
    assert out.token_ids == hf_greedy(peft.get_base_model(), prompt, NEW_TOKENS)


def _mixed(llm, adapters, prompts):
    loras = [lora for lora, _ in adapters] + [None]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    together = llm.generate(prompts, params, lora=loras)
    alone = [llm.generate([p], params, lora=lr)[0] for p, lr in zip(prompts, loras)]
    for t, a, p in zip(together, alone, prompts):
        assert t.token_ids == a.token_ids
        torch.testing.assert_close(_prompt_lp(t, p), _prompt_lp(a, p), atol=1e-5, rtol=0)
    return together


def test_batch_mixing_three_adapters_and_the_base_equals_each_alone(setup):
    tiny, adapters, llm = setup
    prompts = [prompt_ids(PROMPT_LEN - 3 + k, seed=40 + k) for k in range(4)]
    together = _mixed(llm, adapters, prompts)
    assert together[-1].token_ids == hf_greedy(tiny.hf, prompts[-1], NEW_TOKENS)  # the base row: the base
    for (_, peft), out, p in zip(adapters, together, prompts):
        assert out.token_ids == hf_greedy(peft.get_base_model(), p, NEW_TOKENS)


def test_more_adapters_than_slots_run_in_groups(setup):
    tiny, adapters, _ = setup
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=128,
              lora={"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": 1})
    try:
        prompts = [prompt_ids(PROMPT_LEN, seed=50 + k) for k in range(4)]
        together = _mixed(llm, adapters, prompts)
        for (_, peft), out, p in zip(adapters, together, prompts):
            assert out.token_ids == hf_greedy(peft.get_base_model(), p, NEW_TOKENS)
    finally:
        llm.close()
