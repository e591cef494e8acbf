"""What the parity tests of the state-layer models (Mamba2, MiniMax, Qwen3-Next) share.

``TinyStateModel`` holds a tiny random transformers model saved to a folder and the ``LLM``s built
over it; ``StateModelParity`` is the engine behaviour each of them must show against transformers
(a test module subclasses it and provides a ``tiny`` fixture): fp32 prompt logprobs within 1e-4
and greedy tokens identical under the contiguous and paged caches, the state carried across
chunked-prefill chunks of 1, 7 and 64 tokens (other sequences decoding beside it), a batch equal
to each prompt alone, and preemption recomputing from a fresh state slot.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmplug import LLM, SamplingParams
from support.hf_models import hf_logprobs, prompt_ids
from support.moe_models import hf_greedy_loop

PROMPT_LEN = 24
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CACHES = {"contiguous": {"kvcache": "contiguous"}, "paged": {"kvcache": "paged"}}


class TinyStateModel:
    def __init__(self, hf, path: Path) -> None:
        self.hf = hf.eval()
        self.path = path
        hf.save_pretrained(path)
        self._llms: dict[str, LLM] = {}

    def llm(self, **overrides) -> LLM:
        """An ``LLM`` over the folder (fp32, CPU), built once per overrides."""
        key = json.dumps(overrides, sort_keys=True)
        if key not in self._llms:
            self._llms[key] = LLM(str(self.path), dtype="float32", device="cpu", max_model_len=256, **overrides)
        return self._llms[key]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """transformers' greedy continuation (a loop over its forward with its cache)."""
        return hf_greedy_loop(self.hf, prompt, n)


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """lmplug's logprob of each prompt token after the first, float64."""
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))],
                        dtype=torch.float64)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    ref = hf_logprobs(hf, prompt)
    return torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))], dtype=torch.float64)


class StateModelParity:
    """Engine behaviour against transformers; the module provides the ``tiny`` fixture."""

    @pytest.mark.parametrize("cache", list(CACHES))
    def test_prompt_logprobs_match_hf(self, tiny, cache):
        prompt = prompt_ids(PROMPT_LEN, seed=1)
        ref = hf_prompt_logprobs(tiny.hf, prompt)
        torch.testing.assert_close(prompt_logprobs(tiny.llm(**CACHES[cache]), prompt), ref, atol=1e-4, rtol=0)
        assert ref.std() > 0.1  # the prompt was not trivially predictable

    @pytest.mark.parametrize("cache", list(CACHES))
    def test_greedy_matches_hf(self, tiny, cache):
        prompt = prompt_ids(PROMPT_LEN, seed=3)
        assert tiny.llm(**CACHES[cache]).generate([prompt], GREEDY)[0].token_ids == tiny.greedy(prompt, NEW_TOKENS)

    @pytest.mark.parametrize("budget", [1, 7, 64])
    def test_chunked_prefill_carries_the_state(self, tiny, budget):
        """A prompt cut into chunks of ``budget`` tokens (with other sequences decoding beside it):
        every chunk starts from the state the last one left in the slot (and attends to the K/V
        of the chunks before it)."""
        llm = tiny.llm(kvcache="paged", scheduler={"backend": "continuous", "max_num_batched_tokens": budget,
                                                   "max_num_seqs": 4})
        prompts = [prompt_ids(n, seed=20 + n) for n in (PROMPT_LEN, 9, 17)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == tiny.greedy(prompt, 12)
        torch.testing.assert_close(prompt_logprobs(llm, prompts[0]), hf_prompt_logprobs(tiny.hf, prompts[0]),
                                   atol=1e-4, rtol=0)

    @pytest.mark.parametrize("cache", list(CACHES))
    def test_batch_matches_alone(self, tiny, cache):
        prompts = [prompt_ids(n, seed=10 + n) for n in (5, 13, 24)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm = tiny.llm(**CACHES[cache])
        together = [o.token_ids for o in llm.generate(prompts, params)]
        assert together == [llm.generate([p], params)[0].token_ids for p in prompts]

    def test_preemption_recomputes_from_a_fresh_state(self, tiny):
        """Too few KV blocks for every sequence at once: the continuous scheduler preempts (frees
        the sequence's blocks and state slot) and recomputes it; outputs equal transformers'."""
        llm = tiny.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 16},
                       scheduler={"backend": "continuous", "max_num_seqs": 4})
        prompts = [prompt_ids(n, seed=40 + n) for n in (10, 12, 14, 9)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert llm.engine.scheduler.num_preemptions > 0
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == tiny.greedy(prompt, 12)
