"""The real demo model (SmolLM2-135M-Instruct GGUF, Q4_1): lmplug vs transformers loading the same file."""

import pytest
import torch

from lmplug import LLM, SamplingParams

DENSE = {"method": "gguf", "dequantize_at_load": True}  # transformers dequantizes GGUF weights to float

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def hf_model(demo_gguf):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(demo_gguf.parent), gguf_file=demo_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(demo_gguf):
    """The weights dequantized at load, as transformers reads a GGUF: these tests compare the model's
    math with transformers'. The packed path (``quant: gguf``'s default, 8-bit activations like
    llama.cpp) is measured by perplexity and KL instead (tests/plugins/quant/test_gguf_packed.py)."""
    return LLM(str(demo_gguf), dtype="float32", max_model_len=512, quant=DENSE)


def test_greedy_tokens_match_transformers(llm, hf_model):
    for messages in PROMPTS:
        ids = llm.apply_chat_template(messages)
        ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
        assert ours.token_ids == hf_greedy(hf_model, ids, 40)


def hf_greedy(model, ids, n):
    """Greedy decoding with transformers' own forward and KV cache, EOS not special
    (``generate(min_new_tokens=...)`` would forbid EOS instead of ignoring it)."""
    out = []
    with torch.inference_mode():
        step = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def test_prompt_logprobs_match_transformers(llm, hf_model):
    ids = llm.apply_chat_template(PROMPTS[0])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
    ours = torch.tensor([out.prompt_logprobs[i + 1][ids[i + 1]].logprob for i in range(len(ids) - 1)])
    theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)


def test_chat_answer_is_sensible(llm):
    out = llm.chat(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("kv", [
    {"backend": "paged", "block_size": 16},
    {"backend": "paged", "block_size": 8, "prefix_caching": True},
])
def test_paged_cache_and_continuous_batching_keep_greedy_output(demo_gguf, llm, kv):
    prompts = [llm.apply_chat_template(m) for m in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    paged = LLM(str(demo_gguf), dtype="float32", max_model_len=512, kvcache=kv, scheduler="continuous",
                quant=DENSE)
    # twice: with prefix caching the second round reuses the shared system-prompt blocks
    for _ in range(2):
        assert [o.token_ids for o in paged.generate(prompts, params)] == expected
