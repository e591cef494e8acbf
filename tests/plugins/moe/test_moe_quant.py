"""Quantized experts of MoE models against HF transformers running the dequantized weights.

- RTN (``quant: {method: rtn}``, a float checkpoint rounded at load): every expert is
  quantized on its own, per group of input features, like any linear layer; the router
  (``mlp.gate``) and Qwen2-MoE's shared-expert gate stay float. The reference is the HF
  model with the same weights fake-quantized by ``fake_rtn`` below, written from the
  formula (symmetric, ``scale = max|w| / qmax`` per group of one row), not with lmplug's code.
- GPTQ (and AWQ): each expert's w1/w3/w2 (gate/up/down) stored as qweight/qzeros/scales(/g_idx)
  under the per-expert names, as GPTQModel/AutoGPTQ (AutoAWQ) write Mixtral and Qwen-MoE, packed
  by the independent ``quant_packers``; the reference is HF with the dequantized weights.

Paths: experts dequantized at load and stacked (the default; any moe backend runs them),
and experts kept packed (``dequantize_at_load: false``), dequantized per expert per call by
the ``reference`` backend. Broken expert tensors are load errors naming the tensor.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import quant_packers as qp
from support.hf_models import hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.moe_models import TinyMoE, hf_greedy_loop, save_stacked
from support.quant_checkpoints import LINEARS, WEIGHTS, fake_rtn, llm, prompt_lp, ref_lp

from lmplug import LLM, ModelLoadError, SamplingParams

pytestmark = pytest.mark.hf

MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's attention
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_quant")
    cache: dict[str, TinyMoE] = {}

    def get(name: str) -> TinyMoE:
        if name not in cache:
            cache[name] = TinyMoE(name, root)
        return cache[name]

    return get


def assert_matches_hf(model: LLM, hf, atol: float = 2e-4) -> None:
    prompt = prompt_ids(20, seed=1)
    torch.testing.assert_close(prompt_lp(model, prompt), ref_lp(hf, prompt), atol=atol, rtol=0)
    prompt = prompt_ids(16, seed=3)
    out = model.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy_loop(hf, prompt, NEW_TOKENS)


# -- RTN ------------------------------------------------------------------------------------------

def rtn_hf(hf, bits: int, group_size: int):
    """A copy of ``hf`` whose linear weights (attention, dense and shared MLPs, every expert) are
    fake-quantized; the router and the shared-expert gate stay as they are."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            module, _, param = name.rpartition(".")
            if param in ("gate_up_proj", "down_proj") and module.endswith(".experts"):  # [E, out, in]
                for e in range(p.shape[0]):
                    group = p.shape[2] if group_size == -1 else group_size
                    p[e] = fake_rtn(p[e], bits, group)
            elif param == "weight" and module.rpartition(".")[2] in LINEARS + MLA_LINEARS:
                p.copy_(fake_rtn(p, bits, p.shape[1] if group_size == -1 else group_size))
    return hf


RTN_CASES = {
    # name: (model, bits, group_size, dequantize_at_load)
    "mixtral-int8-g32-dense": ("mixtral", 8, 32, True),
    "mixtral-int4-g16-packed": ("mixtral", 4, 16, False),
    "qwen2_moe-int4-g16-dense": ("qwen2_moe", 4, 16, True),
    "qwen3_moe-int8-rowwise-packed": ("qwen3_moe", 8, -1, False),
}


@pytest.mark.parametrize("case", list(RTN_CASES))
def test_rtn_experts_match_fake_quantized_hf(models, case):
    name, bits, group, dense = RTN_CASES[case]
    tiny = models(name)
    hf = rtn_hf(tiny.hf, bits, group)
    model = llm(tiny.path, quant={"method": "rtn", "bits": bits, "group_size": group, "dequantize_at_load": dense})
    block = model.engine.parts.model.layers[0].mlp
    assert block.gate.weight.dtype == torch.float32  # the router is not quantized
    torch.testing.assert_close(block.gate.weight, tiny.hf.model.layers[0].mlp.gate.weight, atol=0, rtol=0)
    experts = block.experts
    if dense:  # stacked, and exactly the fake-quantized weights (not the float ones)
        ref = hf.model.layers[0].mlp.experts
        torch.testing.assert_close(experts.w_gate_up, ref.gate_up_proj, atol=1e-6, rtol=0)
        torch.testing.assert_close(experts.w_down, ref.down_proj, atol=1e-6, rtol=0)
        assert not torch.equal(experts.w_gate_up, tiny.hf.model.layers[0].mlp.experts.gate_up_proj)
    else:  # kept packed: int8 values (int4: two per byte) and per-group scales, per expert
        assert experts.packed and not hasattr(experts, "w_gate_up")
        holder = experts.gate_up_proj[3]
        assert not hasattr(holder, "weight") and holder.qweight.dtype in (torch.int8, torch.uint8)
        groups = 64 // (64 if group == -1 else group)
        assert tuple(holder.scales.shape) == (holder.out_features, groups)
    assert_matches_hf(model, hf)


def test_rtn_experts_of_a_stacked_v5_checkpoint(models, tmp_path):
    """transformers-5 stacked experts are quantized per expert too."""
    tiny = models("qwen3_moe")
    path = save_stacked(tiny.hf, tmp_path / "v5")
    model = llm(path, quant={"method": "rtn", "bits": 4, "group_size": 16})
    assert_matches_hf(model, rtn_hf(tiny.hf, 4, 16))


def test_rtn_deepseek_v3_experts(tmp_path):
    """DeepSeek-V3 (MLA, sigmoid grouped routing, shared experts): routed experts quantized per expert,
    the router with its correction bias left in float."""
    from support.moe_models import TinyDeepseek

    tiny = TinyDeepseek("v3", tmp_path)
    model = llm(tiny.path, quant={"method": "rtn", "bits": 8, "group_size": 16})
    block = model.engine.parts.model.layers[1].mlp
    torch.testing.assert_close(block.gate.e_score_correction_bias,
                               tiny.hf.model.layers[1].mlp.gate.e_score_correction_bias, atol=0, rtol=0)
    hf = rtn_hf(tiny.hf, 8, 16)
    torch.testing.assert_close(block.experts.w_down, hf.model.layers[1].mlp.experts.down_proj, atol=1e-6, rtol=0)
    assert_matches_hf(model, hf)


def test_fused_backend_runs_dequantized_experts(models, kernel_device):
    """``fused`` (Triton, on ``kernel_device``: interpreted on the CPU or compiled on a GPU) takes
    the dense dequantized experts: same greedy tokens as ``reference`` on the same quantized model
    on the same device, and the same prompt log-probs."""
    tiny = models("mixtral")
    quant = {"method": "rtn", "bits": 4, "group_size": 32}
    prompt = prompt_ids(10, seed=5)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def on_device(**overrides) -> LLM:
        return LLM(str(tiny.path), dtype="float32", device=kernel_device, max_model_len=128, quant=quant,
                   **overrides)

    fused, reference = on_device(moe="fused"), on_device(moe="reference")
    assert fused.engine.resolved.backends["moe"].name == "fused"
    assert reference.engine.resolved.backends["moe"].name == "reference"
    assert (fused.generate([prompt], params)[0].token_ids
            == reference.generate([prompt], params)[0].token_ids)
    torch.testing.assert_close(prompt_lp(fused, prompt), prompt_lp(reference, prompt), atol=1e-4, rtol=0)


def test_packed_experts_need_a_backend_that_runs_them(models):
    tiny = models("mixtral")
    with pytest.raises(ModelLoadError, match=r"moe backend 'fused'.*'rtn'.*dequantize_at_load: false"):
        llm(tiny.path, quant={"method": "rtn", "bits": 8, "group_size": 32, "dequantize_at_load": False},
            moe="fused")


# -- GPTQ checkpoints -------------------------------------------------------------------------------

FORMATS = {  # config.json quantization_config, packer
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False,
              "checkpoint_format": "gptq"},
             lambda w, seed: qp.gptq_tensors(w, bits=4, group_size=16, desc_act=True, v1=True, seed=seed)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "GEMM"},
            lambda w, seed: qp.awq_tensors(w, group_size=16)),
}
# per-expert tensors in the checkpoint: (layer, expert, projection); the block is renamed in memory
_FILE_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# projection -> (HF stacked parameter, which half of gate_up: 0 gate, 1 up, None: down)
_HF_EXPERT = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
              "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "w3": "w1", "up_proj": "gate_proj"}


def write_packed(tiny: TinyMoE, dest, fmt: str):
    """Quantize every linear of tiny's checkpoint (attention, shared expert, each expert; not the
    routers) into ``fmt`` tensors under the per-expert names; return HF with the dequantized weights."""
    qconfig, quantize = FORMATS[fmt]
    shutil.copytree(tiny.path, dest)
    hf = copy.deepcopy(tiny.hf)
    out = {}
    for name, tensor in load_file(str(dest / WEIGHTS)).items():
        module, _, param = name.rpartition(".")
        projection = module.rpartition(".")[2]
        expert = _FILE_EXPERT.fullmatch(name)
        if param != "weight" or (projection not in LINEARS and expert is None):
            out[name] = tensor
            continue
        # projections reading the same input (q/k/v, gate/up) get one act-order permutation
        seed = zlib.crc32(f"{module.rpartition('.')[0]}.{SAME_INPUT.get(projection, projection)}".encode())
        packed, dense = quantize(tensor, seed)
        out.update({f"{module}.{k}": v for k, v in packed.items()})
        with torch.no_grad():
            if expert is None:
                hf.get_parameter(name).copy_(dense)
            else:
                layer, e, proj = int(expert[1]), int(expert[2]), expert[3]
                target, half = _HF_EXPERT[proj]
                stacked = getattr(hf.model.layers[layer].mlp.experts, target)
                rows = dense.shape[0]
                (stacked[e] if half is None else stacked[e, half * rows:(half + 1) * rows]).copy_(dense)
    save_file(out, str(dest / WEIGHTS), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dest / "config.json").write_text(json.dumps(config))
    return hf


@pytest.fixture(scope="module")
def gptq(models, tmp_path_factory):
    cache = {}

    def get(name: str, fmt: str = "gptq"):
        if (name, fmt) not in cache:
            folder = tmp_path_factory.mktemp(f"{fmt}_{name}") / "model"
            cache[name, fmt] = folder, write_packed(models(name), folder, fmt)
        return cache[name, fmt]

    return get


@pytest.mark.parametrize("name,fmt", [("mixtral", "gptq"), ("qwen2_moe", "gptq"), ("mixtral", "awq")])
def test_packed_checkpoint_matches_dequantized_hf(gptq, name, fmt):
    folder, hf = gptq(name, fmt)
    names = load_file(str(folder / WEIGHTS)).keys()
    assert any(n.endswith(("experts.3.down_proj.qweight", "experts.3.w2.qweight")) for n in names)
    assert not [n for n in names if ".experts." in n and n.endswith(".weight")]  # every expert packed
    model = llm(folder)
    experts = model.engine.parts.model.layers[0].mlp.experts
    assert not experts.packed  # dequantized at load, stacked
    torch.testing.assert_close(experts.w_gate_up, hf.model.layers[0].mlp.experts.gate_up_proj, atol=1e-6, rtol=0)
    assert_matches_hf(model, hf)


def test_gptq_packed_experts_match_dequantized_hf(gptq):
    folder, hf = gptq("mixtral")
    model = llm(folder, quant={"method": "gptq", "dequantize_at_load": False, "kernel": "torch"})
    experts = model.engine.parts.model.layers[1].mlp.experts
    assert experts.packed and hasattr(experts.down_proj[0], "qweight")
    assert_matches_hf(model, hf)


def broken(gptq, tmp_path, edit):
    folder, _ = gptq("mixtral")
    dest = tmp_path / "broken"
    shutil.copytree(folder, dest)
    tensors = load_file(str(dest / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(dest / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        llm(dest)
    return str(info.value)


def test_missing_expert_scales_are_named(gptq, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.3.w3.scales"
    msg = broken(gptq, tmp_path, lambda t: t.pop(name))
    assert "missing" in msg and name in msg


def test_odd_expert_tensor_is_named(gptq, tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.2.w2.qweight"
    # down: 128 inputs -> qweight [128 / 8, 64]; stored packed along the output instead
    msg = broken(gptq, tmp_path, lambda t: t.__setitem__(name, torch.zeros(128, 8, dtype=torch.int32)))
    assert name in msg and "(128, 8)" in msg and "(16, 64)" in msg


def test_expert_gate_and_up_must_share_g_idx(gptq, tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.1.w3.g_idx"
    msg = broken(gptq, tmp_path, lambda t: t.__setitem__(name, t[name].flip(0).contiguous()))
    assert name in msg and "g_idx" in msg


def test_float_expert_in_a_gptq_checkpoint_is_named(gptq, tmp_path):
    """An expert left in float where the method expects packed tensors: its packed tensors are missing."""
    prefix = "model.layers.1.block_sparse_moe.experts.0.w2"

    def edit(t):
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            t.pop(f"{prefix}.{suffix}")
        t[f"{prefix}.weight"] = torch.zeros(64, 128)

    msg = broken(gptq, tmp_path, edit)
    assert "missing" in msg and f"{prefix}.qweight" in msg


def test_parameter_counts_do_not_depend_on_storage(models):
    """Total vs active parameters (``lmplug bench``) count packed experts as their weights: the
    idle experts are the same number of parameters whether stored packed or dense."""
    tiny = models("mixtral")
    packed = llm(tiny.path, quant={"method": "rtn", "bits": 4, "group_size": 32, "dequantize_at_load": False})
    assert packed.engine.parts.model.layers[0].mlp.experts.packed
    plain, counts = tiny.llm().engine.parts.model.parameter_counts(), packed.engine.parts.model.parameter_counts()
    assert plain[0] - plain[1] == counts[0] - counts[1] == 2 * (8 - 2) * 3 * 64 * 128
    assert plain[0] == sum(p.numel() for p in tiny.hf.parameters())


def test_reference_runs_per_expert_modules_like_stacked_weights():
    """The packed-experts form of ``reference_experts`` (per-expert callables) computes what the
    stacked form does, with experts that get no token and a token routed twice to one expert."""
    from lmplug_moe.reference import reference_experts

    g = torch.Generator().manual_seed(0)
    num, hidden, inter = 6, 32, 16
    w_gate_up, w_down = torch.randn(num, 2 * inter, hidden, generator=g), torch.randn(num, hidden, inter, generator=g)
    x = torch.randn(7, hidden, generator=g)
    ids = torch.tensor([[0, 2], [2, 0], [4, 4], [0, 2], [2, 4], [4, 0], [0, 0]])  # 1, 3, 5 idle
    weights = torch.rand(7, 2, generator=g)
    modules = ([lambda t, w=w: t @ w.T for w in w_gate_up], [lambda t, w=w: t @ w.T for w in w_down])
    stacked = reference_experts(x, ids, weights, w_gate_up, w_down)
    torch.testing.assert_close(reference_experts(x, ids, weights, *modules), stacked, atol=1e-5, rtol=1e-5)
    gate, up = (x[2] @ w_gate_up[4].T).chunk(2)  # token 2: expert 4 twice
    expected = (weights[2].sum() * (torch.nn.functional.silu(gate) * up) @ w_down[4].T)
    torch.testing.assert_close(stacked[2], expected, atol=1e-4, rtol=1e-5)
