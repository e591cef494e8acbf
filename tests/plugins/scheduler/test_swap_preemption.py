"""Swap preemption (``scheduler: {preemption: swap}``): a preempted sequence's K/V (and state)
leave the pool and come back, and its output is what it would have been without preemption.

A pool of 16 blocks of 4 tokens cannot hold four sequences growing to ~30 tokens each, so the
continuous scheduler preempts; with ``swap`` the victims keep their computed tokens. Outputs are
compared with an engine whose pool holds everything (greedy, seeded sampling, int8 KV), and the
swap space must be empty once the requests are done or aborted.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError

pytestmark = pytest.mark.hf

TINY_POOL = {"backend": "paged", "block_size": 4, "num_blocks": 16}
PROMPTS = [prompt_ids(n, seed=40 + n) for n in (10, 12, 14, 9)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("swap"))


def _llm(tiny, kvcache: dict, preemption: str | None = None) -> LLM:
    scheduler = {"backend": "continuous", "max_num_seqs": 4}
    if preemption:
        scheduler["preemption"] = preemption
    return LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64, kvcache=kvcache,
               scheduler=scheduler)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                    SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_swapped_sequences_resume_with_identical_output(tiny, params, dtype):
    roomy = _llm(tiny, {"backend": "paged", "dtype": dtype})
    swapping = _llm(tiny, {**TINY_POOL, "dtype": dtype}, "swap")
    expected = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    assert [o.token_ids for o in swapping.generate(PROMPTS, params)] == expected
    scheduler = swapping.engine.scheduler
    assert scheduler.num_swaps > 0 and scheduler.num_swaps == scheduler.num_preemptions
    assert swapping.engine.kv.swap.num_swapped_in == swapping.engine.kv.swap.num_swapped_out
    assert swapping.engine.kv.swap.used == 0


def test_no_swap_space_falls_back_to_recompute(tiny):
    llm = _llm(tiny, {**TINY_POOL, "swap_space_gb": 0}, "swap")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_swaps == 0
    assert out == [o.token_ids for o in _llm(tiny, {"backend": "paged"}).generate(PROMPTS, params)]


def test_a_swapped_request_aborted_frees_its_swap_space(tiny):
    llm = _llm(tiny, TINY_POOL, "swap")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    while not engine.kv.swap.used:
        engine.step()
        assert engine.has_unfinished_requests()
    swapped = [s for s in engine.scheduler.waiting if engine.kv.is_swapped(s)]
    assert swapped
    engine.abort_request(swapped[0].request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.swap.used == 0


def test_swap_needs_a_kv_cache_that_swaps(tiny):
    with pytest.raises(ConfigError, match="preemption: swap.*'swap' feature"):
        _llm(tiny, {"backend": "contiguous"}, "swap")


def test_a_state_model_swaps_its_state_too(tmp_path):
    """Mamba2: the conv and SSM state slots are swapped with the (empty) K/V."""
    from transformers import AutoModelForCausalLM, Mamba2Config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Mamba2Config(
        vocab_size=512, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=8,
        num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(kvcache: dict, preemption: str | None = None) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64, kvcache=kvcache,
                  scheduler={"backend": "continuous", "max_num_seqs": 4,
                             **({"preemption": preemption} if preemption else {})})
        return [o.token_ids for o in llm.generate(PROMPTS, params)], llm

    swapped, llm = run(TINY_POOL, "swap")
    assert llm.engine.scheduler.num_swaps > 0
    assert swapped == run({"backend": "paged"})[0]


def test_swap_is_refused_under_tensor_parallelism():
    """Blocks are copied in rank 0's pool only, so the plan refuses swap with more than one rank."""
    from types import SimpleNamespace

    from lmplug.config import EngineConfig, resolve
    from lmplug.engine.plan import _check_swap_support

    resolved = resolve(EngineConfig.from_dict({"model": "m", "kvcache": "paged",
                                               "scheduler": {"backend": "continuous", "preemption": "swap"}}),
                       device="cpu", dtype="float32")
    _check_swap_support(resolved, SimpleNamespace(world_size=1))
    with pytest.raises(ConfigError, match="preemption: swap is not built for tensor parallelism"):
        _check_swap_support(resolved, SimpleNamespace(world_size=2))
