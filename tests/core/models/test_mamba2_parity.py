"""Parity with HF transformers for tiny random Mamba2 checkpoints (a pure SSM: state layers only).

transformers builds, randomises and saves each model; lmplug loads the folder and runs it
through the engine: the SSD scan and causal conv1d of the mixer backend (``torch`` on CPU),
each sequence's conv and SSM state in a slot of the KV cache's state pool. The state must carry
across chunked-prefill chunks (budgets 1, 7 and 64 tokens), restart cleanly after preemption
(recompute from a fresh slot), and stay per sequence in a batch. The greedy reference is a loop
over HF's forward with its cache (``hf_greedy_loop``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.hf_models import hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.moe_models import hf_greedy_loop

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError, ModelLoadError

pytestmark = pytest.mark.hf

_BASE = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "expand": 2, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.1}
SPECS = {
    # 8 heads of 16 over 2 groups of B/C, chunks of 8 (prompts span several)
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "conv_kernel": 4,
               "chunk_size": 8, "tie_word_embeddings": False},
    # one group, tied head, kernel 3, no conv bias, 3 layers, chunk 5 (not a power of two)
    "mamba2_tied": {"num_heads": 4, "head_dim": 32, "state_size": 8, "n_groups": 1, "conv_kernel": 3,
                    "use_conv_bias": False, "chunk_size": 5, "num_hidden_layers": 3, "tie_word_embeddings": True},
}
PROMPT_LEN = 24
NEW_TOKENS = 32


class TinyMamba2:
    def __init__(self, name: str, root, **extra) -> None:
        from transformers import AutoModelForCausalLM, Mamba2Config

        torch.manual_seed(0)
        self.hf = AutoModelForCausalLM.from_config(Mamba2Config(**{**_BASE, **SPECS[name], **extra}),
                                                   dtype=torch.float32).eval()
        with torch.no_grad():  # norms and conv biases random too, so a mix-up shows
            for pname, p in self.hf.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif pname.endswith("conv1d.bias"):
                    p.copy_(0.2 * torch.randn_like(p))
        self.path = root / name
        self.hf.save_pretrained(self.path)
        self._llms: dict[str, LLM] = {}

    def llm(self, **overrides) -> LLM:
        key = json.dumps(overrides, sort_keys=True)
        if key not in self._llms:
            self._llms[key] = LLM(str(self.path), dtype="float32", device="cpu", max_model_len=256, **overrides)
        return self._llms[key]


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    return TinyMamba2(request.param, tmp_path_factory.mktemp("mamba2"))


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))],
                        dtype=torch.float64)


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    ref = hf_logprobs(hf, prompt)
    return torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))], dtype=torch.float64)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CACHES = {"contiguous": {"kvcache": "contiguous"}, "paged": {"kvcache": "paged"}}


def test_the_engine_runs_state_layers_only(tiny):
    engine = tiny.llm().engine
    spec = engine.kv.spec
    assert spec.num_layers == 0 and len(spec.states) == tiny.hf.config.num_hidden_layers
    assert engine.resolved.backends["mixer"].name == "torch"  # auto on CPU, no mixer section
    assert [t.name for t in spec.states[0].tensors] == ["conv", "ssm"]
    assert spec.states[0].tensors[1].dtype == torch.float32


@pytest.mark.parametrize("cache", list(CACHES))
def test_prompt_logprobs_match_hf(tiny, cache):
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    ref = _hf_prompt_logprobs(tiny.hf, prompt)
    torch.testing.assert_close(_prompt_logprobs(tiny.llm(**CACHES[cache]), prompt), ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.1  # the prompt was not trivially predictable


@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_matches_hf(tiny, cache):
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    out = tiny.llm(**CACHES[cache]).generate([prompt], GREEDY)[0]
    assert out.token_ids == hf_greedy_loop(tiny.hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_carries_the_state(tiny, budget):
    """A prompt cut into chunks of ``budget`` tokens (with other sequences decoding beside it):
    every chunk starts from the state the last one left in the slot."""
    llm = tiny.llm(kvcache="paged", scheduler={"backend": "continuous", "max_num_batched_tokens": budget,
                                               "max_num_seqs": 4})
    prompts = [prompt_ids(n, seed=20 + n) for n in (PROMPT_LEN, 9, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy_loop(tiny.hf, prompt, 12)
    torch.testing.assert_close(_prompt_logprobs(llm, prompts[0]), _hf_prompt_logprobs(tiny.hf, prompts[0]),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("cache", list(CACHES))
def test_batch_matches_alone(tiny, cache):
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 13, 24)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = tiny.llm(**CACHES[cache])
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


def test_preemption_recomputes_from_a_fresh_state(tiny):
    """A pool too small for every sequence at once: the continuous scheduler preempts (frees the
    sequence's blocks and state slot) and recomputes it; outputs equal HF's."""
    llm = tiny.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 16},
                   scheduler={"backend": "continuous", "max_num_seqs": 4})
    prompts = [prompt_ids(n, seed=40 + n) for n in (10, 12, 14, 9)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy_loop(tiny.hf, prompt, 12)


def test_n_samples_run_as_separate_sequences(tiny):
    """n > 1 on a state model: each sample its own sequence (and state); seeded, the samples equal
    the same seeds run one by one."""
    llm = tiny.llm(kvcache="paged")
    prompt = prompt_ids(12, seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7, ignore_eos=True)
    outs = llm.generate([prompt], params)[0]
    assert len(outs.outputs) == 3
    for i, sample in enumerate(outs.outputs):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=7 + i,
                                                      ignore_eos=True))[0]
        assert sample.token_ids == alone.token_ids


def test_triton_mixer_generates_the_same_tokens(tiny):
    """The Triton kernels (interpreted on CPU) inside the engine: HF's greedy tokens."""
    if tiny.hf.config.num_hidden_layers != 2:
        pytest.skip("one model is enough for the interpreted kernels")
    prompt = prompt_ids(12, seed=4)
    llm = tiny.llm(mixer="triton", kvcache="paged")
    assert llm.engine.resolved.backends["mixer"].name == "triton"
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids \
        == hf_greedy_loop(tiny.hf, prompt, 6)


def test_a_finite_dt_limit_is_applied(tmp_path):
    """time_step_limit clamps the discretized dt in the prefill, as transformers does."""
    tiny = TinyMamba2("mamba2", tmp_path, time_step_limit=(0.0, 0.05))
    assert math.isfinite(tiny.hf.config.time_step_limit[1])
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    torch.testing.assert_close(_prompt_logprobs(tiny.llm(), prompt), _hf_prompt_logprobs(tiny.hf, prompt),
                               atol=1e-4, rtol=0)


# -- refused at load ------------------------------------------------------------------------------

def test_prefix_caching_is_refused_by_name(tiny):
    with pytest.raises(ConfigError, match="prefix_caching"):
        LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64,
            kvcache={"backend": "paged", "prefix_caching": True})


def test_speculative_decoding_is_refused_by_name(tiny):
    with pytest.raises(ConfigError, match="speculative.*state layers"):
        LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64,
            speculative={"method": "ngram", "num_tokens": 2})


def test_a_state_pool_that_does_not_fit_memory_gb_is_refused(tiny):
    with pytest.raises(ConfigError, match="memory_gb.*state slots"):
        LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64,
            kvcache={"backend": "paged", "memory_gb": 1e-6})


def test_a_bad_time_step_limit_names_the_key(tmp_path):
    tiny = TinyMamba2("mamba2", tmp_path)
    cfg = json.loads((tiny.path / "config.json").read_text())
    cfg["time_step_limit"] = [1.0]
    (tiny.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="time_step_limit"):
        LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64)
