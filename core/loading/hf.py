"""HF model folders: ``config.json`` plus safetensors, single file or sharded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lmplug.errors import ModelLoadError
from lmplug.interfaces.checkpoint import ModelSource
from lmplug.loading.validate import check_safetensors_header

INDEX = "model.safetensors.index.json"


def load_hf_dir(path: Path) -> ModelSource:
    config = _read_json(path / "config.json")
    files = _weight_files(path)
    names: list[str] = []
    where: dict[str, Path] = {}
    for f in files:
        for name in _tensor_names(f):
            names.append(name)
            where[name] = f

    def iter_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (a safetensors handle)
                        yield name, handle.get_tensor(name)
            except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
                raise ModelLoadError(f"{f}: cannot read tensors ({exc})") from None

    def iter_slices() -> Iterator[tuple[str, object]]:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (a safetensors handle)
                        yield name, handle.get_slice(name)
            except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
                raise ModelLoadError(f"{f}: cannot read tensors ({exc})") from None

    generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from lmplug.loading.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_hf_dir(path)
    return ModelSource(path=path, format="hf", hf_config=config, tensor_names=names,
                       iter_tensors=iter_tensors, tokenizer=tokenizer, generation_config=generation,
                       iter_slices=iter_slices)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing (an HF model folder needs config.json and safetensors)") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: expected a 'weight_map' object")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise ModelLoadError(f"{path}: only pickle checkpoints (.bin/.pt) found; lmplug reads "
                                 "safetensors (convert with `save_pretrained(safe_serialization=True)`)")
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return files


def _tensor_names(path: Path) -> list[str]:
    # Check the header against the format and the file size before trusting it: a truncated
    # or hostile file must fail here, with its name and key, not deep inside a tensor read.
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ModelLoadError(f"{path}: truncated or not a safetensors file (header of {n} bytes, "
                                     f"file of {size})")
            header = json.loads(fh.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(f"{path}: safetensors header is not valid JSON") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: safetensors header is nested too deeply") from None
    try:
        return check_safetensors_header(header, size - 8 - n)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("truncated"):  # in whole-file bytes, as the user sees the file
            end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
            message = f"truncated: tensors need {8 + n + end} bytes, the file has {size} ({message})"
        raise ModelLoadError(f"{path}: {message}") from None
