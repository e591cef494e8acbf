"""GPTQ (v1, v2, act-order, 8-bit, group -1) and AWQ checkpoints load in lmplug and compute what
their dequantized weights compute in HF transformers; broken checkpoints are clear errors.

Each checkpoint is the tiny random Llama of ``hf_models`` with every linear weight quantized
and packed by ``quant_packers`` (numpy, from the published layouts, not lmplug's code), plus
a ``quantization_config`` in config.json. The reference is the HF model with those weights
dequantized. Paths: dense weight cached at load (the CPU default), per-call PyTorch
unpacking, and the Triton kernel under the interpreter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.hf_models import get_model, hf_greedy, hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.quant_checkpoints import (
    FORMATS,
    LINEARS,
    edit_tensors,
    fake_rtn,
    llm,
    load_error,
    prompt_lp,
    ref_lp,
    set_config,
    write_quantized,
)

from lmplug import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.getbasetemp() / "quant_models")


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request, tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "model"
    return request.param, folder, write_quantized(tiny, folder, request.param)


def test_matches_dequantized_hf(checkpoint):
    _, folder, hf = checkpoint
    model = llm(folder)
    prompt = prompt_ids(16, seed=1)
    torch.testing.assert_close(prompt_lp(model, prompt), ref_lp(hf, prompt), atol=1e-4, rtol=0)
    out = model.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 8)


PATHS = {
    "torch": {"dequantize_at_load": False, "kernel": "torch"},
    "triton": {"kernel": "triton"},  # under TRITON_INTERPRET=1 (tests/conftest.py)
}


@pytest.mark.parametrize("path", list(PATHS))
def test_packed_paths_match_dequantized_hf(checkpoint, path):
    fmt, folder, hf = checkpoint
    model = llm(folder, quant={"method": FORMATS[fmt][0]["quant_method"], **PATHS[path]})
    layer = model.engine.parts.model.layers[0].self_attn.qkv_proj
    assert not hasattr(layer, "weight") and layer.use_kernel == (path == "triton")  # really packed
    prompt = prompt_ids(8, seed=2)
    torch.testing.assert_close(prompt_lp(model, prompt), ref_lp(hf, prompt), atol=2e-4, rtol=0)


# -- broken checkpoints -----------------------------------------------------------------------

@pytest.fixture
def gptq_dir(tiny, tmp_path):
    write_quantized(tiny, tmp_path / "model", "gptq_v1_actorder_g32")
    return tmp_path / "model"


def test_wrong_packing_shape(gptq_dir):
    name = "model.layers.1.self_attn.k_proj.qweight"
    # qweight packed along the output (AWQ-style) instead of the input: [in, out/8]
    edit_tensors(gptq_dir, lambda t: t.__setitem__(name, torch.zeros(64, 4, dtype=torch.int32)))
    msg = load_error(gptq_dir)
    assert name in msg and "(64, 4)" in msg and "(8, 32)" in msg


def test_missing_scales(gptq_dir):
    name = "model.layers.0.mlp.down_proj.scales"
    edit_tensors(gptq_dir, lambda t: t.pop(name))
    msg = load_error(gptq_dir)
    assert "missing" in msg and name in msg


def test_unsupported_bits(gptq_dir):
    set_config(gptq_dir, quantization_config={**FORMATS["gptq_v1_actorder_g32"][0], "bits": 3})
    msg = load_error(gptq_dir)
    assert "quantization_config" in msg and "bits" in msg and "3" in msg and "gptq" in msg


def test_unknown_quant_method_lists_available(gptq_dir):
    set_config(gptq_dir, quantization_config={"quant_method": "hqq", "bits": 4})
    msg = load_error(gptq_dir)
    assert "'hqq'" in msg and "awq" in msg and "gptq" in msg and "rtn" in msg


def test_g_idx_out_of_range(gptq_dir):
    name = "model.layers.0.self_attn.o_proj.g_idx"
    edit_tensors(gptq_dir, lambda t: t[name].fill_(7))  # 64 inputs / 32 = 2 groups
    msg = load_error(gptq_dir)
    assert "g_idx" in msg and "2" in msg


def test_fused_shards_must_share_g_idx(gptq_dir):
    name = "model.layers.0.self_attn.v_proj.g_idx"
    edit_tensors(gptq_dir, lambda t: t.__setitem__(name, t[name].flip(0).contiguous()))
    msg = load_error(gptq_dir)
    assert "g_idx" in msg and "shard" in msg


def test_explicit_section_overrides_checkpoint_options(gptq_dir):
    """`quant: {method: gptq, ...}` keeps the checkpoint's bits and group size."""
    model = llm(gptq_dir, quant={"method": "gptq", "dequantize_at_load": False})
    assert model.generate([prompt_ids(4, seed=3)], SamplingParams(max_tokens=2))[0].token_ids


# -- rtn: a float checkpoint quantized at load time ---------------------------------------------

@pytest.mark.parametrize("bits,group,dense", [(8, 32, True), (4, 32, False), (4, -1, True)])
def test_rtn_matches_rounded_hf(tiny, bits, group, dense):
    hf = copy.deepcopy(tiny.hf)
    for name, p in hf.named_parameters():
        if name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in LINEARS:
            p.data.copy_(fake_rtn(p.data, bits, p.shape[1] if group == -1 else group))
    model = llm(tiny.path, quant={"method": "rtn", "bits": bits, "group_size": group,
                                  "dequantize_at_load": dense})
    prompt = prompt_ids(12, seed=4)
    torch.testing.assert_close(prompt_lp(model, prompt), ref_lp(hf, prompt), atol=2e-4, rtol=0)
