"""PEFT LoRA adapters from their folder (``adapter_config.json`` + ``adapter_model.safetensors``).

What is read: each adapted module's ``lora_A`` [r, in] and ``lora_B`` [out, r] (rank per module,
so ``rank_pattern`` works), ``lora_alpha`` and ``use_rslora`` (scaling ``alpha / r``, or
``alpha / sqrt(r)``), kept beside the weights (the slots fold it into float32 B; the native
slots keep a 16-bit file's values as they are, ``lmplug.kit.lora``). What is refused, by name: DoRA (``use_dora``), trained
biases (``bias``), ``modules_to_save``, ``alpha_pattern``, adapters on the embedding or the LM
head, modules this model has no linear layer for, shapes that are not the base model's, a rank
above ``max_lora_rank``, and a file that is not a readable safetensors file. Every error names
the adapter and the field or module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from lmplug.errors import ModelLoadError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
PREFIX = "base_model.model."


@dataclass
class HostAdapter:
    """An adapter's weights in host memory: checkpoint module name -> (A [r, in], B [out, r], the
    scaling), A and B in the file's dtype (float16 / bfloat16 files stay 16-bit)."""

    name: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, *_ in self.modules.values())


def read_adapter(name: str, path: str | Path, targets: Mapping[str, tuple[int, int]],
                 max_rank: int) -> HostAdapter:
    """Adapter ``name`` from folder ``path`` for a model whose adaptable modules are ``targets``
    (checkpoint module name -> (in, out) features). Raises ``ModelLoadError``."""
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({folder})"
    if not folder.is_dir():
        raise ModelLoadError(f"{where}: not a folder (expected a PEFT adapter folder with {CONFIG} and {WEIGHTS})")
    config = _read_config(folder / CONFIG, where)
    scale_of = _scaling(config, where)
    weights = _read_weights(folder, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        module, kind = _split_key(key, where)
        pairs.setdefault(module, {})[kind] = tensor
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for module, found in sorted(pairs.items()):
        if module not in targets:
            raise ModelLoadError(f"{where}: target module {module!r}: the base model has no such linear "
                                 f"layer (adaptable: the attention and MLP projections, e.g. "
                                 f"{', '.join(sorted(targets)[:3])}, ...)")
        if set(found) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(found)).pop()
            raise ModelLoadError(f"{where}: {WEIGHTS}: {module}.{missing}.weight is missing")
        a, b = found["lora_A"], found["lora_B"]
        d_in, d_out = targets[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != d_in or b.shape[0] != d_out or b.shape[1] != a.shape[0]:
            raise ModelLoadError(f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                 f"fit the base layer ({d_in} in, {d_out} out): an adapter for another base "
                                 f"model? (expected lora_A [r, {d_in}], lora_B [{d_out}, r])")
        rank = a.shape[0]
        if rank > max_rank:
            raise ModelLoadError(f"{where}: {module}: rank r={rank} is above lora.max_lora_rank={max_rank} "
                                 "(raise max_lora_rank in the lora: section)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ModelLoadError(f"{where}: {module}: the weights hold NaN or infinite values")
        modules[module] = (a, b, scale_of(rank))
    if not modules:
        raise ModelLoadError(f"{where}: {WEIGHTS} holds no lora_A / lora_B weights")
    return HostAdapter(name, modules)


def _read_config(path: Path, where: str) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"{where}: {CONFIG} is missing")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelLoadError(f"{where}: {CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{where}: {CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: {CONFIG}: expected a JSON object, got {type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ModelLoadError(f"{where}: {CONFIG}: peft_type {peft_type!r} is not supported (LORA only)")
    refused = {"use_dora": "DoRA adapters are not supported",
               "modules_to_save": "fully trained modules beside the adapter are not supported",
               "alpha_pattern": "per-module lora_alpha is not supported",
               "fan_in_fan_out": "transposed (Conv1D) weights are not supported"}
    for field, why in refused.items():
        if config.get(field):
            raise ModelLoadError(f"{where}: {CONFIG}: {field}={config[field]!r}: {why}")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(f"{where}: {CONFIG}: bias={config['bias']!r}: trained biases are not supported "
                             "(bias must be \"none\")")
    return config


def _scaling(config: dict, where: str):
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ModelLoadError(f"{where}: {CONFIG}: lora_alpha must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ModelLoadError(f"{where}: {CONFIG}: use_rslora must be true or false, got {rslora!r}")
    return (lambda r: alpha / math.sqrt(r)) if rslora else (lambda r: alpha / r)


def _read_weights(folder: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS
    if not path.is_file():
        other = " (found adapter_model.bin: convert it to safetensors)" if (folder / "adapter_model.bin").exists() else ""
        raise ModelLoadError(f"{where}: {WEIGHTS} is missing{other}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{where}: {WEIGHTS} is not a readable safetensors file ({exc})") from None


def _split_key(key: str, where: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (module, "lora_A")."""
    name = key.removeprefix(PREFIX)
    if "lora_embedding" in name or "embed_tokens" in name:
        raise ModelLoadError(f"{where}: {key}: LoRA on the embedding (embed_tokens) is not supported")
    if "lm_head" in name:
        raise ModelLoadError(f"{where}: {key}: LoRA on the LM head (lm_head) is not supported")
    for kind in ("lora_A", "lora_B"):
        marker = f".{kind}."
        if marker in name and name.endswith(".weight"):
            return name.split(marker)[0], kind
    if "magnitude" in name:
        raise ModelLoadError(f"{where}: {key}: DoRA adapters are not supported")
    raise ModelLoadError(f"{where}: {WEIGHTS}: unexpected tensor {key!r} (expected MODULE.lora_A.weight and "
                         "MODULE.lora_B.weight)")
