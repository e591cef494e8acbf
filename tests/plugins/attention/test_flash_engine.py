"""The ``flash`` backend inside the engine: a tiny random Mistral whose sliding window (16) is
shorter than prompt + output, against HF transformers' greedy decoding.

The kernels run under ``TRITON_INTERPRET=1`` (set by conftest.py). The HF
reference is a manual greedy loop over ``forward`` with its KV cache (``past_key_values``)
(``generate(min_new_tokens=...)`` would mask EOS out of the argmax instead of
ignoring it, which is what ``ignore_eos=True`` means here).
"""

from __future__ import annotations

import inspect
import os
from collections import Counter

import pytest
import torch

from lmplug import LLM, SamplingParams

pytestmark = pytest.mark.hf

# flash claims the CPU only under the interpreter; with TRITON_INTERPRET=0 on a GPU box, use the GPU
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("flash needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
WINDOW = 16
PROMPT_LEN = 24
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        initializer_range=0.1)  # a wider init than 0.02 keeps greedy argmaxes clear of near-ties
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp("tiny_mistral")
    model.save_pretrained(path)
    return path, model


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    # transformers 5.x renamed ``past_key_values`` to ``cache`` (argument and output field)
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([tokens[-1:]]), use_cache=True, **{cache: out[cache]})
    return tokens


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1, float64."""
    logprobs = model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    return torch.stack([logprobs[i - 1, prompt[i]] for i in range(1, len(prompt))])


def our_prompt_logprobs(out, prompt: list[int]) -> torch.Tensor:
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))],
                        dtype=torch.float64)


def count_kernel_calls(llm: LLM) -> Counter:
    """Wrap the flash backend's kernel entry points (shared by every layer) to count calls."""
    backend = llm.engine.runner.model.layers[0].self_attn.backend
    assert backend.name == "flash"
    calls: Counter = Counter()
    for attr in ("_decode", "_prefill", "_varlen"):
        fn = getattr(backend, attr)

        def counted(*args, _fn=fn, _name=attr, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        setattr(backend, attr, counted)
    return calls


def check_against_hf(model, prompt, out) -> None:
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    torch.testing.assert_close(our_prompt_logprobs(out, prompt), hf_prompt_logprobs(model, prompt),
                               atol=1e-4, rtol=0)


def test_flash_greedy_matches_hf_past_the_window(mistral):
    path, model = mistral
    llm = LLM(str(path), attention="flash", kvcache="contiguous", max_model_len=128, device=DEVICE,
              dtype="float32")
    assert llm.engine.resolved.backends["attention"].name == "flash"
    calls = count_kernel_calls(llm)
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt], params)[0]
    assert PROMPT_LEN + NEW_TOKENS > PROMPT_LEN > WINDOW  # the window masks keys in prefill and decode
    check_against_hf(model, prompt, out)
    # one prompt step (packed K/V, nothing cached) then decodes, in each of the 2 layers
    assert calls == Counter(_varlen=2, _decode=2 * (NEW_TOKENS - 1))


def test_flash_chunked_prefill_and_mixed_steps_match_hf(mistral):
    """A token budget of 10 splits the prompts into chunks (read back through the cache) and puts
    one sequence's decodes in the same steps as the other's prefill chunks."""
    path, model = mistral
    llm = LLM(str(path), attention="flash", kvcache="contiguous", max_model_len=128, device=DEVICE,
              dtype="float32", scheduler={"backend": "static", "max_num_batched_tokens": 10})
    calls = count_kernel_calls(llm)
    prompts = [prompt_ids(PROMPT_LEN, seed=2), prompt_ids(19, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        check_against_hf(model, prompt, out)
    assert calls["_prefill"] > 0 and calls["_decode"] > 0
