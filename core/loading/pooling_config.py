"""A checkpoint's own embedding recipe: its sentence-transformers modules and Matryoshka sizes.

sentence-transformers saves a model as a chain of modules: ``modules.json`` lists them in order
(the Transformer, a ``Pooling`` module with ``<its folder>/config.json``, an optional
``Normalize``). vLLM reads the same files for its pooler's defaults; so does lmplug, so that an
embedding checkpoint embeds as its authors meant without a ``pooler`` section. Matryoshka
truncation (``dimensions``) is allowed where config.json declares it with vLLM's keys
``matryoshka_dimensions`` (the sizes trained for) or ``is_matryoshka``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmplug.errors import ModelLoadError

# sentence-transformers' pooling modes -> lmplug's pooling types (vLLM's CLS / MEAN / LAST); its
# config says ``"pooling_mode": "mean"`` (or a list) since v5, ``"pooling_mode_mean_tokens": true`` before
ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
ST_LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
             "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class ModelPooling:
    """What the checkpoint says about pooling; None fields: it says nothing (the defaults apply)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    unsupported: str | None = None  # why its sentence-transformers recipe cannot be followed here
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()  # empty with ``matryoshka``: any size up to hidden_size
    headless: bool = False  # a base model without an LM head (``headless``): it embeds, never generates


def headless(hf_config: Mapping[str, Any]) -> bool:
    """config.json names only base-model classes (``LlamaModel``, ``Qwen3Model``): the checkpoint was
    saved without its LM head, as sentence-transformers and embedding models save decoders."""
    heads = [a for a in hf_config.get("architectures") or () if isinstance(a, str)]
    return bool(heads) and all(a.endswith("Model") and not a.endswith("LMHeadModel") for a in heads)


def read_pooling(folder: Path | None, hf_config: Mapping[str, Any]) -> ModelPooling:
    """The recipe of an HF folder (None or a GGUF file: config.json's Matryoshka keys only)."""
    dims = hf_config.get("matryoshka_dimensions") or ()
    if not isinstance(dims, list | tuple) or not all(isinstance(d, int) and d > 0 for d in dims):
        where = folder / "config.json" if folder is not None and folder.is_dir() else "config.json"
        raise ModelLoadError(f"{where}: matryoshka_dimensions must be a list of positive integers, got {dims!r}")
    common = {"matryoshka": bool(dims) or bool(hf_config.get("is_matryoshka")),
              "matryoshka_dimensions": tuple(sorted(dims)), "headless": headless(hf_config)}
    modules_file = folder / "modules.json" if folder is not None and folder.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return ModelPooling(**common)
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise ModelLoadError(f"{modules_file}: expected a list of modules, each with a 'type'")
    types = [m["type"].rpartition(".")[2] for m in modules]  # the class: its module path moved in v5
    pooling_type, unsupported = None, None
    if "Pooling" in types:
        where = _inside(folder, modules[types.index("Pooling")].get("path"), modules_file) / "config.json"
        pooling_type, unsupported = _st_mode(_json(where), where)
    extra = [t for t in types if t not in ("Transformer", "Pooling", "Normalize")]
    if extra and unsupported is None:
        unsupported = (f"{modules_file} chains module {extra[0]!r} after the transformer, which lmplug does not "
                       "apply (it pools and normalizes only)")
    return ModelPooling(pooling_type, "Normalize" in types, unsupported, **common)


def _st_mode(config: Any, where: Path) -> tuple[str | None, str | None]:
    """One sentence-transformers Pooling config as (pooling type, or why it cannot be followed)."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: expected a JSON object (sentence-transformers' Pooling config)")
    mode = config.get("pooling_mode")
    modes = ([mode] if isinstance(mode, str) else list(mode)) if mode else [v for k, v in ST_LEGACY.items()
                                                                          if config.get(k)]
    if len(modes) != 1 or modes[0] not in ST_MODES:
        return None, (f"{where} asks for pooling mode {' + '.join(map(str, modes)) or 'none'}; lmplug pools with "
                      f"one of {', '.join(ST_MODES)}")
    if config.get("include_prompt", True) is False:
        return None, f"{where} sets include_prompt false (instruction tokens left out of the pool), not supported"
    return ST_MODES[modes[0]], None


def _inside(folder: Path, sub: Any, modules_file: Path) -> Path:
    """A module's folder, which must lie inside the checkpoint's."""
    path = (folder / sub).resolve() if isinstance(sub, str) else None
    if path is None or not path.is_relative_to(folder.resolve()):
        raise ModelLoadError(f"{modules_file}: module path {sub!r} is not a folder inside the checkpoint")
    return path


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing (named by the checkpoint's modules.json)") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON ({exc})") from None
