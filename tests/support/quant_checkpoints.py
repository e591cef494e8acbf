"""What the quantized-checkpoint tests share: engine and HF log-probs, config and tensor edits,
the round-to-nearest reference written from its formula, and the GPTQ / AWQ checkpoints of
test_quant_formats.py (``FORMATS``, ``write_quantized``; the tensor-parallel tests load them too), and the
``quantization_config`` of a compressed-tensors checkpoint (``ct_config``)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmplug import LLM, ModelLoadError, SamplingParams
from support import quant_packers as qp
from support.hf_models import hf_logprobs

WEIGHTS = "model.safetensors"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llm(folder, **overrides) -> LLM:
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, **overrides)


def prompt_lp(model: LLM, prompt: list[int]) -> torch.Tensor:
    """The engine's log-prob of each prompt token after the first, float64."""
    out = model.generate([prompt], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))],
                        dtype=torch.float64)


def ref_lp(hf, prompt: list[int]) -> torch.Tensor:
    """The same log-probs from a transformers model."""
    ref = hf_logprobs(hf, prompt)
    return torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))], dtype=torch.float64)


def set_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def load_error(folder, **overrides) -> str:
    """The ModelLoadError loading ``folder`` must raise, as text."""
    with pytest.raises(ModelLoadError) as info:
        llm(folder, **overrides)
    return str(info.value)


def edit_tensors(folder, edit) -> None:
    """Rewrite ``folder``'s safetensors file after ``edit(tensors)`` changed the dict in place."""
    tensors = load_file(str(folder / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})


def fake_rtn(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``weight [out, in]`` rounded to ``bits`` (symmetric) per group of ``group`` inputs of one row,
    back in float."""
    qmax = 2 ** (bits - 1) - 1
    out = torch.empty_like(weight)
    for start in range(0, weight.shape[1], group):
        block = weight[:, start:start + group].double()
        scale = block.abs().max(dim=1, keepdim=True).values / qmax
        out[:, start:start + group] = (torch.round(block / scale).clamp(-qmax - 1, qmax) * scale).to(weight.dtype)
    return out


FORMATS = {
    "gptq_v1_actorder_g32": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
         "checkpoint_format": "gptq"},
        lambda w, seed: qp.gptq_tensors(w, bits=4, group_size=32, desc_act=True, v1=True, seed=seed)),
    "gptq_v2_g-1": (
        {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False,
         "checkpoint_format": "gptq_v2"},
        lambda w, seed: qp.gptq_tensors(w, bits=4, group_size=-1, desc_act=False, v1=False)),
    "gptq8_v1_g32": (
        {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False},
        lambda w, seed: qp.gptq_tensors(w, bits=8, group_size=32, desc_act=False, v1=True)),
    "awq_g32": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "GEMM"},
        lambda w, seed: qp.awq_tensors(w, group_size=32)),
}


def write_quantized(tiny, dest, fmt: str):
    """Quantize tiny's linear weights into folder ``dest``; return the dequantized HF model."""
    qconfig, quantize = FORMATS[fmt]
    shutil.copytree(tiny.path, dest)
    hf = copy.deepcopy(tiny.hf)
    out = {}
    for name, tensor in load_file(str(dest / WEIGHTS)).items():
        module, _, param = name.rpartition(".")
        if param != "weight" or module.rpartition(".")[2] not in LINEARS:
            out[name] = tensor
            continue
        packed, dense = quantize(tensor, act_order_seed(module))
        out.update({f"{module}.{k}": v for k, v in packed.items()})
        hf.get_parameter(name).data.copy_(dense)
    save_file(out, str(dest / WEIGHTS), metadata={"format": "pt"})
    set_config(dest, quantization_config=qconfig)
    return hf


def act_order_seed(module: str) -> int:
    """Projections reading the same input get the same act-order permutation, as GPTQ gives them
    (its order sorts the input's Hessian diagonal), so q/k/v and gate/up share one ``g_idx``."""
    layer = int(module.split(".")[2])
    shared = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2}
    return layer * 10 + shared.get(module.rpartition(".")[2], 3)


def ct_config(fmt: str, weights: dict, acts: dict | None, ignore=("lm_head",)) -> dict:
    group = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights},
             "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": list(ignore), "quantization_status": "compressed", "kv_cache_scheme": None}
