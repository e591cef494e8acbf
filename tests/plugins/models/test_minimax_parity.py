"""Parity with HF transformers for tiny random MiniMax checkpoints (lightning attention hybrid).

transformers builds, randomises (norms too) and saves each model; lmplug loads the folder and runs
it through the engine: softmax-attention layers on the KV cache, lightning-attention layers on
the mixer backend (``torch`` on CPU) with each sequence's [H, D, D] state in a slot of the KV
cache's state pool, Mixtral-style MoE in every layer, and the alpha/beta residual factors (set
away from 1 here so that a misplaced one shows). The state must carry across chunked-prefill
chunks (budgets 1, 7 and 64 tokens), restart cleanly after preemption and stay per sequence in
a batch.

The greedy reference is a loop over HF's forward with its cache, given explicit positions: when
layer 0 is a lightning layer, ``MiniMaxCache.get_seq_length()`` reads layer 0's (empty) K/V and
reports 0, so a loop without positions would rotate every decode step's keys as position 0.
``test_reference_loop_is_hf_full_recompute`` checks that loop against HF's cache-free forward.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.hf_models import _BASE, build_hf_model, hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.moe_models import save_stacked
from support.state_models import (
    CACHES,
    NEW_TOKENS,
    PROMPT_LEN,
    StateModelParity,
    TinyStateModel,
    hf_prompt_logprobs,
    prompt_logprobs,
)

from lmplug import LLM, SamplingParams
from lmplug.errors import ModelLoadError

pytestmark = pytest.mark.hf

FACTORS = {"full_attn_alpha_factor": 0.7, "full_attn_beta_factor": 1.3, "linear_attn_alpha_factor": 1.1,
           "linear_attn_beta_factor": 0.8, "mlp_alpha_factor": 0.9, "mlp_beta_factor": 1.2}
SPECS = {
    # layer 0 lightning; 4 heads of 16 (GQA: 2 KV heads in the softmax layer), 4 experts, top-2;
    # HF's blocks of 8 tokens, so prompts span several
    "linear_first": {"num_hidden_layers": 3, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "block_size": 8, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                     **FACTORS},
    # layer 0 softmax; 8 heads of 8, no GQA, 8 experts, top-2, blocks of 5, two lightning layers in a row
    "full_first": {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8,
                   "num_local_experts": 8, "num_experts_per_tok": 2, "block_size": 5,
                   "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
                   "full_attn_beta_factor": 0.6, "mlp_alpha_factor": 1.4,
                   "rms_norm_eps": 1e-2},  # the lightning output norm keeps its own 1e-6
}


class TinyMiniMax(TinyStateModel):
    def __init__(self, name: str, root) -> None:
        from transformers import AutoConfig

        self.name = name
        cfg = AutoConfig.for_model("minimax", **{**_BASE, **SPECS[name]})
        super().__init__(build_hf_model(cfg), root / name)  # norms (the lightning output norm too) random

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return hf_greedy(self.hf, prompt, n)  # explicit positions: see the module docstring


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    return TinyMiniMax(request.param, tmp_path_factory.mktemp("minimax"))


@torch.no_grad()
def hf_greedy_steps(hf, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens and their logprobs: one forward over the prompt, then one per token on
    HF's cache, each at its explicit position (see the module docstring)."""
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(n):
        lp = out.logits[0, -1].float().log_softmax(-1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp[tokens[-1]].item())
        pos = len(ids) + len(tokens) - 1
        out = hf(torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[pos]]),
                 attention_mask=torch.ones(1, pos + 1, dtype=torch.long), cache=out.cache, use_cache=True)
    return tokens, logprobs


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    return hf_greedy_steps(hf, ids, n)[0]


def test_the_engine_splits_attention_and_state_layers(tiny):
    engine = tiny.llm().engine
    kinds = tiny.hf.config.layer_types
    spec = engine.kv.spec
    assert spec.num_layers == kinds.count("full_attention")
    assert [s.layer for s in spec.states] == [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
    heads, head_dim = tiny.hf.config.num_attention_heads, tiny.hf.config.head_dim
    assert [(t.name, t.shape, t.dtype) for t in spec.states[0].tensors] == \
        [("lightning", (heads, head_dim, head_dim), torch.float32)]
    assert engine.resolved.backends["mixer"].name == "torch"  # auto on CPU, no mixer section
    assert engine.resolved.backends["moe"].name == "reference"


def test_slopes_are_hf_slopes(tiny):
    """The decay rates lmplug derives equal the buffers HF computed (and saved) for each layer."""
    model = tiny.llm().engine.parts.model
    for i, kind in enumerate(tiny.hf.config.layer_types):
        if kind == "linear_attention":
            ref = tiny.hf.model.layers[i].self_attn.slope_rate.flatten()
            torch.testing.assert_close(model.layers[i].self_attn.slope, ref, rtol=1e-6, atol=0)


def test_reference_loop_is_hf_full_recompute(tiny):
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    ids, recomputed = list(prompt), []
    with torch.no_grad():
        for _ in range(8):
            recomputed.append(int(tiny.hf(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(recomputed[-1])
    assert hf_greedy(tiny.hf, prompt, 8) == recomputed


@pytest.mark.parametrize("cache", list(CACHES))
def test_decode_logprobs_match_hf(tiny, cache):
    """Each decode step's logprob (the lightning state update, K/V appended) within 1e-4 of HF's."""
    prompt = prompt_ids(PROMPT_LEN, seed=3)
    out = tiny.llm(**CACHES[cache]).generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                      ignore_eos=True, logprobs=1))[0]
    tokens, ref = hf_greedy_steps(tiny.hf, prompt, NEW_TOKENS)
    assert out.token_ids == tokens
    ours = torch.tensor([entry[tok].logprob for tok, entry in zip(tokens, out.logprobs, strict=True)],
                        dtype=torch.float64)
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=torch.float64), atol=1e-4, rtol=0)


@pytest.mark.slow  # the interpreted kernels; Mamba2's engine test and TestTritonMixer stay in make test
def test_triton_mixer_generates_the_same_tokens(tiny):
    """The Triton lightning kernels (interpreted on CPU) inside the engine: HF's greedy tokens."""
    if tiny.name != "linear_first":
        pytest.skip("one model is enough for the interpreted kernels")
    prompt = prompt_ids(12, seed=4)
    llm = tiny.llm(mixer="triton", kvcache="paged")
    assert llm.engine.resolved.backends["mixer"].name == "triton"
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids \
        == hf_greedy(tiny.hf, prompt, 6)


def _edit_config(tiny: TinyMiniMax, tmp_path, drop: tuple[str, ...] = (), **changes) -> str:
    """A copy of the checkpoint with config.json keys ``drop`` removed and ``changes`` set."""
    import shutil

    path = tmp_path / f"{tiny.name}_edited"
    shutil.copytree(tiny.path, path)
    cfg = json.loads((path / "config.json").read_text())
    for key in drop:
        del cfg[key]
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_stacked_v5_checkpoint_matches_hf(tiny, tmp_path):
    """transformers 5's own layout (``mlp.experts.gate_up_proj`` stacked, not Mixtral's
    ``block_sparse_moe.experts.N.w1``) loads to the same logprobs."""
    llm = LLM(str(save_stacked(tiny.hf, tmp_path / "v5")), dtype="float32", device="cpu", max_model_len=256)
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    torch.testing.assert_close(prompt_logprobs(llm, prompt), hf_prompt_logprobs(tiny.hf, prompt),
                               atol=1e-4, rtol=0)


def test_older_attn_type_list_config_loads(tiny, tmp_path):
    """MiniMax-Text-01's own config lists the layers as ``attn_type_list`` (1 full, 0 lightning)."""
    types = [int(kind == "full_attention") for kind in tiny.hf.config.layer_types]
    llm = LLM(_edit_config(tiny, tmp_path, drop=("layer_types",), attn_type_list=types), dtype="float32",
              device="cpu", max_model_len=256)
    prompt = prompt_ids(PROMPT_LEN, seed=1)
    torch.testing.assert_close(prompt_logprobs(llm, prompt), hf_prompt_logprobs(tiny.hf, prompt),
                               atol=1e-4, rtol=0)


# -- refused at load ------------------------------------------------------------------------------


def test_layer_types_of_the_wrong_length_are_refused(tiny, tmp_path):
    short = tiny.hf.config.layer_types[:-1]
    with pytest.raises(ModelLoadError, match=r"layer_types.*one entry per layer"):
        LLM(_edit_config(tiny, tmp_path, layer_types=short), dtype="float32", device="cpu", max_model_len=64)


def test_another_activation_is_refused(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="hidden_act.*silu"):
        LLM(_edit_config(tiny, tmp_path, hidden_act="gelu"), dtype="float32", device="cpu", max_model_len=64)


class TestEngineParity(StateModelParity):
    """Logprobs, greedy tokens, chunked prefill, batching and preemption against transformers."""
