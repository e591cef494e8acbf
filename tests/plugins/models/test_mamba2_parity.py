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
from support.state_models import (
    PROMPT_LEN,
    StateModelParity,
    TinyStateModel,
    hf_prompt_logprobs,
    prompt_logprobs,
)

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


class TinyMamba2(TinyStateModel):
    def __init__(self, name: str, root, **extra) -> None:
        from transformers import AutoModelForCausalLM, Mamba2Config

        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(Mamba2Config(**{**_BASE, **SPECS[name], **extra}), dtype=torch.float32)
        with torch.no_grad():  # norms and conv biases random too, so a mix-up shows
            for pname, p in hf.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif pname.endswith("conv1d.bias"):
                    p.copy_(0.2 * torch.randn_like(p))
        super().__init__(hf, root / name)


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    return TinyMamba2(request.param, tmp_path_factory.mktemp("mamba2"))


def test_the_engine_runs_state_layers_only(tiny):
    engine = tiny.llm().engine
    spec = engine.kv.spec
    assert spec.num_layers == 0 and len(spec.states) == tiny.hf.config.num_hidden_layers
    assert engine.resolved.backends["mixer"].name == "torch"  # auto on CPU, no mixer section
    assert [t.name for t in spec.states[0].tensors] == ["conv", "ssm"]
    assert spec.states[0].tensors[1].dtype == torch.float32


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
    torch.testing.assert_close(prompt_logprobs(tiny.llm(), prompt), hf_prompt_logprobs(tiny.hf, prompt),
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


class TestEngineParity(StateModelParity):
    """Logprobs, greedy tokens, chunked prefill, batching and preemption against transformers."""
