"""Write a quantized checkpoint folder: ``config.json``, ``model.safetensors``, the tokenizer.

The folder is self-contained: from an HF folder the tokenizer files are
copied; from a GGUF file the tokenizer lmplug rebuilt from the GGUF metadata
is saved as ``tokenizer.json`` with a ``tokenizer_config.json`` naming its
special tokens and chat template, and ``config.json`` carries the HF keys
(``lmplug.loading.gguf`` derived them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmplug.api import ModelSource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "tokenizer.model")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def write_checkpoint(out_dir: Path, source: ModelSource, tensors: dict[str, torch.Tensor],
                     quantization_config: dict, dtype: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(source.hf_config)
    config["torch_dtype"] = dtype
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(out_dir, source)


def write_tokenizer(out_dir: Path, source: ModelSource) -> None:
    if source.format == "hf" and source.path.is_dir():
        for name in TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copy2(source.path / name, out_dir / name)
        return
    tok = source.tokenizer
    if tok is not None:
        tok.backend.save(str(out_dir / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tok.add_bos_token,
                  "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                  **{k: v for k, v in tok.special_tokens.items() if k in ("unk_token", "pad_token")}}
        if tok.chat_template:
            config["chat_template"] = tok.chat_template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if source.generation_config:
        (out_dir / "generation_config.json").write_text(json.dumps(source.generation_config, indent=2) + "\n")


def float_tensors(tensors: dict[str, torch.Tensor], linear_weights: set[str], dtype: str) -> dict[str, torch.Tensor]:
    """Every tensor but the quantized linear weights, cast to ``dtype``."""
    return {k: v.to(DTYPES[dtype]) for k, v in tensors.items() if k not in linear_weights}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
