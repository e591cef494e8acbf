"""Random PEFT LoRA adapters over the tiny HF models (a helper module, not a test file).

PEFT itself builds and saves each adapter (``get_peft_model`` on a copy of the base model, then
``save_pretrained``): the folder is PEFT's own format, and the ``PeftModel`` is the reference.
PEFT starts B at zero (the adapter would change nothing); both A and B are drawn at random here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(hf, path: Path, *, rank: int, seed: int, targets: list[str] | None = None,
                 alpha: float | None = None, rslora: bool = False, scale: float = 0.3, **extra):
    """Save a random adapter over ``hf`` (not modified) in ``path``; returns the ``PeftModel``
    (its ``get_base_model()``: the transformers model with PEFT's LoRA layers in it, which
    ``generate`` runs as configured)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=targets or ATTENTION + MLP, lora_dropout=0.0, use_rslora=rslora,
                        **extra)
    model = get_peft_model(copy.deepcopy(hf), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model.eval()


def merged(peft_model):
    """The base model with the adapter merged into its weights (PEFT's ``merge_and_unload``)."""
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def write_adapter(folder: Path, targets: dict[str, tuple[int, int]], rank: int = 8, seed: int = 0,
                  scale: float = 0.05, dtype: torch.dtype = torch.float32) -> None:
    """A random adapter in PEFT's saved format (keys ``base_model.model.<module>.lora_A.weight``)
    over ``targets`` (module -> (in, out): an engine's ``adapters.targets``), without a PEFT model
    (the GGUF checkpoints have none), its weights stored in ``dtype``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (d_in, d_out) in targets.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * scale
    save_file({k: t.to(dtype) for k, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_dora": False,
        "target_modules": sorted({m.rpartition(".")[2] for m in targets})}))
