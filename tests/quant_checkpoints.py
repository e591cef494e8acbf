"""What the quantized-checkpoint tests share: engine and HF log-probs, config and tensor edits,
and the round-to-nearest reference written from its formula."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import hf_logprobs
from safetensors.torch import load_file, save_file

from lmplug import LLM, ModelLoadError, SamplingParams

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
