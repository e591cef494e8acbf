"""Medusa heads in the FasterDecoding format: load, save, and compute them.

A folder holds ``medusa_lm_head.safetensors`` (or ``medusa_lm_head.pt``) and
``config.json`` (``medusa_num_heads``, ``medusa_num_layers``). Head ``i`` is
``medusa_num_layers`` residual blocks ``x + SiLU(W x + b)`` (tensors
``{i}.{j}.linear.weight`` [h, h] and ``.bias`` [h]) followed by ``{i}.{L}.weight``
[vocab, h]. From the target's final hidden state at position t (whose logits choose
token t+1), head i predicts token t+i+2.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from lmplug.errors import ConfigError

WEIGHTS = "medusa_lm_head.safetensors"


class ResBlock(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        torch.nn.init.zeros_(self.linear.weight)  # a fresh block starts as the identity
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(torch.nn.ModuleList):
    """``heads[i]`` = residual blocks then a linear to the vocabulary; state-dict keys are the
    published ones (``{i}.{j}.linear.weight``, ``{i}.{L}.weight``)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int) -> None:
        super().__init__(
            torch.nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                                torch.nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads))
        self.num_layers = num_layers

    def blocks(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """The residual blocks of the first ``num_heads`` heads: hidden [B, h] -> [num_heads, B, h]."""
        return torch.stack([head[:-1](hidden) for head in list(self)[:num_heads]])

    def head_weights(self) -> list[torch.Tensor]:
        return [head[-1].weight for head in self]

    @property
    def config(self) -> dict:
        return {"medusa_num_heads": len(self), "medusa_num_layers": self.num_layers}


def load_heads(path: str | Path) -> MedusaHeads:
    """Read a FasterDecoding-format folder (or the weights file itself)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    state = _read_state(path)
    config = _read_config(folder, state)
    num_heads, num_layers = config["medusa_num_heads"], config["medusa_num_layers"]
    final = state.get(f"0.{num_layers}.weight")
    if final is None:
        raise ConfigError(f"speculative: medusa: {path}: no tensor '0.{num_layers}.weight' for "
                          f"medusa_num_layers={num_layers}; found {sorted(state)[:6]}")
    # in the stored dtype, so a head saved from the target's lm_head compares equal to it
    heads = MedusaHeads(final.shape[1], final.shape[0], num_heads, num_layers).to(final.dtype)
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"speculative: medusa: {path}: tensors do not match {num_heads} heads of "
                          f"{num_layers} layers (missing {missing[:4]}, unexpected {unexpected[:4]})")
    return heads


def save_heads(heads: MedusaHeads, folder: str | Path, dtype: torch.dtype = torch.float16,
               extra_config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    (folder / "config.json").write_text(json.dumps({**heads.config, **(extra_config or {})}, indent=2))
    return folder


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    candidates = [path] if path.is_file() else [path / WEIGHTS, path / "medusa_lm_head.pt"]
    for file in candidates:
        if file.suffix == ".safetensors" and file.exists():
            from safetensors.torch import load_file
            return load_file(str(file))
        if file.suffix in (".pt", ".bin") and file.exists():
            return torch.load(file, map_location="cpu", weights_only=True)
    raise ConfigError(f"speculative: medusa: no heads at {path} (expected {WEIGHTS} or "
                      f"medusa_lm_head.pt); train some with `lmplug train-drafter --method medusa`")


def _read_config(folder: Path, state: dict[str, torch.Tensor]) -> dict:
    """``config.json`` when present; else the head and layer counts the tensor names imply."""
    file = folder / "config.json"
    config = json.loads(file.read_text()) if file.exists() else {}
    keys = [k.split(".") for k in state]
    config.setdefault("medusa_num_heads", 1 + max(int(k[0]) for k in keys))
    config.setdefault("medusa_num_layers", max(int(k[1]) for k in keys if len(k) == 3))  # {i}.{L}.weight
    return config
