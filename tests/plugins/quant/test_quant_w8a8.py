"""W8A8 (fp8, int8) and compressed-tensors checkpoints load in lmplug and compute what plain
PyTorch computes with their dequantized weights and fake-quantized activations.

Each checkpoint is the tiny random Llama of ``hf_models`` with its linear weights quantized and
written by ``quant_packers`` (from the published layouts, not lmplug's code) plus a
``quantization_config``. The reference is the HF transformers model with those weights
dequantized and, for W8A8, a forward pre-hook on every quantized linear layer that quantizes
its input the published way (per token / per group / static scale) and dequantizes it again:
the same numbers a real W8A8 GEMM multiplies. Paths: the CPU defaults (fp8: float32 weight
cached, int8: ``torch._int_mm``, int4: dense), the per-call PyTorch reference, and the Triton
kernels on ``kernel_device`` (the CPU under the interpreter, or compiled on a CUDA GPU; fp8 there
needs sm_89+). The scaled GEMM itself is checked against ``scaled_mm_reference`` and the float64
definition at the end.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import quant_packers as qp
from support.devices import interpreted, skip_unless_fp8
from support.hf_models import get_model, hf_greedy, hf_logprobs, one_torch_thread, prompt_ids  # noqa: F401
from support.quant_checkpoints import (
    LINEARS,
    WEIGHTS,
    ct_config,
    edit_tensors,
    llm,
    load_error,
    prompt_lp,
    ref_lp,
    set_config,
)
from support.w8a8_operands import definition, operands

from lmplug import LLM, SamplingParams
from lmplug.loading import open_source

FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}

# name -> (quantization_config, packer(weight, module) -> (tensors, dense),
#          activation fake-quantization (kind, mode, group) or None, ignored(module) -> bool)
FORMATS = {
    "ct_fp8_channel_token": (
        ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}, FP8_TOKEN),
        lambda w, m: qp.fp8_tensor_or_channel(w, per_channel=True), ("fp8", "token", 0), None),
    "ct_fp8_tensor_static": (
        ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"},
                  {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
        lambda w, m: qp.fp8_tensor_or_channel(w, per_channel=False), ("fp8", "static", 0), None),
    "ct_fp8_block32_ignore_down": (
        ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                      "block_structure": [32, 32]},
                  {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True},
                  ignore=("lm_head", "re:.*mlp\\.down_proj$")),
        lambda w, m: qp.fp8_block(w, (32, 32), scale_name="weight_scale"), ("fp8", "group", 32),
        lambda m: m.endswith("mlp.down_proj")),
    "hf_fp8_block128": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
         "weight_block_size": [128, 128]},
        lambda w, m: qp.fp8_block(w, (128, 128)), ("fp8", "group", 128), None),
    "ct_int8_channel_token": (
        ct_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                  {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
        lambda w, m: qp.int8_channel(w), ("int8", "token", 0), None),
    "ct_mixed_fp8_attn_int8_mlp": (
        {**ct_config("float-quantized", {}, None), "config_groups": {
            "attn": {"targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"], "format": "float-quantized",
                     "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                     "input_activations": FP8_TOKEN},
            "mlp": {"targets": ["re:.*mlp\\..*"], "format": "int-quantized",
                    "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
        lambda w, m: qp.fp8_tensor_or_channel(w, True) if "self_attn" in m else qp.int8_channel(w),
        lambda m: ("fp8", "token", 0) if "self_attn" in m else ("int8", "token", 0), None),
    "ct_int4_pack_g32": (
        ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
                  None),
        lambda w, m: qp.pack_quantized(w, 4, 32), None, None),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.getbasetemp() / "w8a8_models")


def calibrate(hf, prompt) -> dict[str, float]:
    """max |input| of every linear layer of the float model on ``prompt`` (static input scales)."""
    amax, hooks = {}, []
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return amax


def write_quantized(tiny, dest, fmt: str):
    """Quantize tiny's linear weights into ``dest``; return the reference HF model (dequantized
    weights, inputs of quantized layers fake-quantized by forward pre-hooks)."""
    qconfig, pack, act_of, ignored = FORMATS[fmt]
    act = act_of
    shutil.copytree(tiny.path, dest)
    hf = copy.deepcopy(tiny.hf)
    static = {k: v / qp.FP8_MAX for k, v in calibrate(tiny.hf, prompt_ids(24, seed=9)).items()}
    out = {}
    for name, tensor in load_file(str(dest / WEIGHTS)).items():
        module, _, param = name.rpartition(".")
        if param != "weight" or module.rpartition(".")[2] not in LINEARS or (ignored and ignored(module)):
            out[name] = tensor
            continue
        packed, dense = pack(tensor, module)
        act = act_of(module) if callable(act_of) else act_of
        out.update({f"{module}.{k}": v for k, v in packed.items()})
        if act is not None and act[1] == "static":
            out[f"{module}.input_scale"] = torch.tensor([static[module]], dtype=torch.float32)
        hf.get_parameter(name).data.copy_(dense)
        if act is not None:
            hf.get_submodule(module).register_forward_pre_hook(input_quantizer(act, static.get(module)))
    save_file(out, str(dest / WEIGHTS), metadata={"format": "pt"})
    set_config(dest, quantization_config=qconfig)
    return hf


def input_quantizer(act, static_scale):
    kind, mode, group = act
    return lambda module, args: (qp.fake_quantize_input(args[0], kind, mode, group, static_scale),)


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request, tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "model"
    return request.param, folder, write_quantized(tiny, folder, request.param)


def test_matches_dequantized_fake_quantized_hf(checkpoint, tiny):
    fmt, folder, hf = checkpoint
    model = llm(folder)
    prompt = prompt_ids(16, seed=1)
    got, want = prompt_lp(model, prompt), ref_lp(hf, prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    out = model.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 8)
    if FORMATS[fmt][2] is not None:  # the activations really are quantized: a float model differs
        float_acts = copy.deepcopy(hf)
        for module in float_acts.modules():
            module._forward_pre_hooks.clear()
        assert (got - ref_lp(float_acts, prompt)).abs().max() > 3e-3


PATHS = {
    "torch_per_call": {"dequantize_at_load": False, "kernel": "torch"},
    "triton": {"kernel": "triton"},  # under TRITON_INTERPRET=1 (tests/conftest.py)
}


@pytest.mark.parametrize("path", list(PATHS))
def test_other_paths_match(checkpoint, path, kernel_device):
    fmt, folder, hf = checkpoint
    method = FORMATS[fmt][0]["quant_method"]
    device = kernel_device if path == "triton" else "cpu"
    if "fp8" in fmt:
        skip_unless_fp8(device)
    model = LLM(str(folder), dtype="float32", device=device, max_model_len=128,
                quant={"method": method, **PATHS[path]})
    layer = model.engine.parts.model.layers[0].self_attn.qkv_proj
    assert not hasattr(layer, "w_dense") and not hasattr(layer, "weight")  # still 8/4-bit
    prompt = prompt_ids(8, seed=2)
    torch.testing.assert_close(prompt_lp(model, prompt), ref_lp(hf, prompt), atol=1e-3, rtol=0)
    # decode steps (one token: the W4A16 GEMV, the W8A8 GEMM with M = 1)
    out = model.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 3)


def test_ignored_layers_stay_float(tmp_path, tiny):
    write_quantized(tiny, tmp_path / "model", "ct_fp8_block32_ignore_down")
    model = llm(tmp_path / "model")
    layers = model.engine.parts.model.layers[1]
    assert layers.mlp.down_proj.quant.name == "none" and layers.mlp.down_proj.weight.dtype == torch.float32
    scheme = layers.mlp.gate_up_proj.quant.scheme
    assert (scheme.kind, scheme.weight_strategy, scheme.block, scheme.act) == ("fp8", "block", (32, 32), "group")


# -- online quantization of a float checkpoint -------------------------------------------------

@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantize_float_checkpoint_at_load(tiny, method):
    hf = copy.deepcopy(tiny.hf)
    kind = "fp8" if method == "fp8" else "int8"
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            pack = qp.fp8_tensor_or_channel(module.weight.data, True) if kind == "fp8" \
                else qp.int8_channel(module.weight.data)
            module.weight.data.copy_(pack[1])
            module.register_forward_pre_hook(lambda mod, args: (qp.fake_quantize_input(args[0], kind, "token"),))
    model = llm(tiny.path, quant={"method": method})
    prompt = prompt_ids(12, seed=4)
    torch.testing.assert_close(prompt_lp(model, prompt), ref_lp(hf, prompt), atol=1e-3, rtol=0)


# -- broken checkpoints -------------------------------------------------------------------------

@pytest.fixture
def fp8_dir(tiny, tmp_path):
    write_quantized(tiny, tmp_path / "model", "ct_fp8_channel_token")
    return tmp_path / "model"


def test_missing_weight_scale(fp8_dir):
    name = "model.layers.0.mlp.down_proj.weight_scale"
    edit_tensors(fp8_dir, lambda t: t.pop(name))
    msg = load_error(fp8_dir)
    assert "missing" in msg and name in msg


def test_wrong_scale_shape(fp8_dir):
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    edit_tensors(fp8_dir, lambda t: t.__setitem__(name, torch.ones(1)))  # per-tensor, config says channel
    msg = load_error(fp8_dir)
    assert name in msg and "(1,)" in msg and "(32, 1)" in msg and str(fp8_dir) in msg


def test_float_weight_in_fp8_checkpoint(fp8_dir):
    name = "model.layers.0.self_attn.o_proj.weight"
    edit_tensors(fp8_dir, lambda t: t.__setitem__(name, t[name].float()))
    msg = load_error(fp8_dir)
    assert name in msg and "float32" in msg and "float8_e4m3fn" in msg


def test_block_scale_wrong_shape(tiny, tmp_path):
    folder = tmp_path / "model"
    write_quantized(tiny, folder, "hf_fp8_block128")
    name = "model.layers.0.mlp.gate_proj.weight_scale_inv"  # [1, 1] for a 128 x 64 weight
    edit_tensors(folder, lambda t: t.__setitem__(name, torch.ones(2, 1)))
    msg = load_error(folder)
    assert name in msg and "(2, 1)" in msg and "(1, 1)" in msg


def test_pack_quantized_wrong_shapes(tiny, tmp_path):
    folder = tmp_path / "model"
    write_quantized(tiny, folder, "ct_int4_pack_g32")
    packed = "model.layers.0.self_attn.q_proj.weight_packed"
    edit_tensors(folder, lambda t: t.__setitem__(packed, torch.zeros(8, 64, dtype=torch.int32)))  # [in/8, out]
    msg = load_error(folder)
    assert packed in msg and "(8, 64)" in msg and "(64, 8)" in msg
    write_quantized(tiny, tmp_path / "model2", "ct_int4_pack_g32")
    shape = "model.layers.1.self_attn.v_proj.weight_shape"
    edit_tensors(tmp_path / "model2", lambda t: t.__setitem__(shape, torch.tensor([64, 64])))
    msg = load_error(tmp_path / "model2")
    assert shape in msg and "[32, 64]" in msg


@pytest.mark.parametrize("change,words", [
    ({"num_bits": 3}, ["num_bits", "3"]),
    ({"strategy": "group", "group_size": 16}, ["strategy", "group"]),
    ({"symmetric": False}, ["symmetric"]),
])
def test_unsupported_scheme(fp8_dir, change, words):
    config = copy.deepcopy(FORMATS["ct_fp8_channel_token"][0])
    config["config_groups"]["group_0"]["weights"].update(change)
    set_config(fp8_dir, quantization_config=config)
    msg = load_error(fp8_dir)
    assert "compressed-tensors" in msg and "config_groups.group_0" in msg
    assert all(w in msg for w in words)


def test_fused_pieces_must_share_a_scheme(fp8_dir):
    config = copy.deepcopy(FORMATS["ct_fp8_channel_token"][0])
    config["ignore"] = ["lm_head", "model.layers.0.self_attn.k_proj"]
    set_config(fp8_dir, quantization_config=config)
    msg = load_error(fp8_dir)
    assert "fused" in msg and "model.layers.0.self_attn.k_proj" in msg


def test_static_activations_need_input_scale(tiny, tmp_path):
    folder = tmp_path / "model"
    write_quantized(tiny, folder, "ct_fp8_tensor_static")
    name = "model.layers.1.mlp.up_proj.input_scale"
    edit_tensors(folder, lambda t: t.pop(name))
    msg = load_error(folder)
    assert "missing" in msg and name in msg


def test_online_method_refuses_a_quantized_checkpoint(fp8_dir):
    """`quant: {method: int8}` (quantize at load) on an fp8 checkpoint would copy fp8 values as
    floats without their scales: a clear error instead."""
    msg = load_error(fp8_dir, quant={"method": "int8"})
    assert "float8_e4m3fn" in msg and "already quantized" in msg


# -- folders written by `lmplug quantize` (another author's code) load here -----------------------

@pytest.mark.parametrize("method", ["fp8", "smoothquant"])
def test_lmplug_quantize_folders_match_their_reference(tmp_path_factory, method):
    """The offline quantizers write compressed-tensors W8A8 folders; lmplug's output equals their
    own fake-quant reference (``fakequant.W8A8Reference``, written independently of these methods)."""
    fakequant = pytest.importorskip("lmplug_quant.quantizers.fakequant")
    from lmplug.cli import main as cli_main

    base = tmp_path_factory.mktemp(f"written_{method}")
    tiny = get_model("llama", base / "float", tokenizer=True)
    out = base / method
    flags = ["--calib-samples", "8", "--calib-len", "64"] + (["-o", "dtype=float32"] if method == "smoothquant" else [])
    assert cli_main(["quantize", str(tiny.path), str(out), "--method", method, *flags]) == 0
    prompt = prompt_ids(16, seed=6)
    ref = fakequant.W8A8Reference(open_source(out), max_len=64).log_probs(prompt, range(len(prompt) - 1))
    want = torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))], dtype=torch.float64)
    torch.testing.assert_close(prompt_lp(llm(out), prompt), want, atol=1e-4, rtol=0)


# -- the scaled GEMM against its PyTorch reference, on the kernel device ---------------------------

def check_gemm(kind: str, m: int, n: int, k: int, group_k: int, out_dtype: torch.dtype, device: str) -> None:
    from lmplug_quant.w8a8_common import scaled_mm_reference
    from lmplug_quant.w8a8_kernels import w8a8_gemm

    if kind == "fp8":
        skip_unless_fp8(device)
    a, sa, w, sw = operands(kind, m, n, k, group_k, seed=m + k + group_k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    want = definition(a, sa, w, sw, group_k) + bias.double()
    ref = scaled_mm_reference(a, sa, w, sw, group_k).double() + bias.double()
    scale = float(want.abs().max())
    torch.testing.assert_close(ref, want, atol=1e-5 * scale, rtol=1e-5)
    y = w8a8_gemm(*(t.to(device) for t in (a, sa, w, sw)), group_k=group_k, bias=bias.to(device),
                  out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.device.type == torch.device(device).type
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[out_dtype]
    torch.testing.assert_close(y.double().cpu(), ref, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("group_k", [0, 32, 128])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_w8a8_gemm_matches_reference(kind, m, group_k, out_dtype, kernel_device):
    # partial tiles in N and K; K = 80 is 2.5 groups of 32 and a partial group of 128
    check_gemm(kind, m, 40, 80, group_k, out_dtype, kernel_device)


@pytest.mark.skipif(interpreted(), reason="GPU-sized shapes are too slow under the interpreter; the small "
                                          "cases run the same code there")
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("m", [1, 16, 64, 1024])
@pytest.mark.parametrize("group_k", [0, 128])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_w8a8_gemm_gpu_sized_shapes(kind, m, group_k, out_dtype, kernel_device):
    """Every M bucket of the launch tables at a real layer's K and N (with a partial N tile)."""
    check_gemm(kind, m, 1000, 2048, group_k, out_dtype, kernel_device)
