"""What every offline quantizer shares: options, the float model, calibration windows, writing.

A method implements ``quantize_model(model, windows, progress) ->
(tensors, quantization_config)``: ``model`` is the float decoder
(``reference.FloatLlama``) whose tensors it may rewrite in place (folded
scales), ``windows`` the calibration token windows (None for methods that
need none). ``tensors`` holds the checkpoint tensors of every quantized
linear layer; the base adds the float tensors and writes the folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar, Literal

import torch
from lmplug_quant.quantizers.calibration import calibration_windows
from lmplug_quant.quantizers.reference import LINEARS, FloatLlama
from lmplug_quant.quantizers.writer import float_tensors, tensor_bytes, write_checkpoint
from pydantic import Field, field_validator

from lmplug.errors import ConfigError
from lmplug.interfaces.checkpoint import ModelSource
from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.quantizer import CalibrationSpec, Progress, Quantizer

CHUNK = 4  # calibration windows per forward (bounds the attention scores' memory)


class QuantizerOptions(BackendOptions):
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        default="float16", description="dtype of the tensors left in floating point (embeddings, "
        "norms, biases) and of the scales")


class GroupOptions(QuantizerOptions):
    bits: Literal[4, 8] = Field(default=4, description="bits per weight")
    group_size: int = Field(default=128, description="input columns per scale/zero; -1: one group per row")

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int) -> int:
        if value != -1 and value <= 0:
            raise ValueError("group_size must be -1 or a positive number of input columns")
        return value


class BaseQuantizer(Quantizer):
    capabilities = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}))
    Options: ClassVar[type[BackendOptions]] = QuantizerOptions

    def quantize(self, model_source: ModelSource, out_dir: Path, calibration: CalibrationSpec,
                 progress: Progress) -> dict:
        started = time.perf_counter()
        model = FloatLlama(model_source, max_len=calibration.seq_len)
        self.check_model(model)
        windows = calibration_windows(model_source.tokenizer, calibration) if self.needs_calibration else None
        tensors, qconfig = self.quantize_model(model, windows, progress)
        seconds = time.perf_counter() - started
        linear_weights = {f"model.layers.{i}.{name}.weight"
                          for i in range(model.cfg.num_layers) for name in LINEARS}
        float_bytes = 2 * sum(model.tensors[k].numel() for k in linear_weights)
        out = {**float_tensors(model.tensors, linear_weights, self.options.dtype), **tensors}
        write_checkpoint(out_dir, model_source, out, qconfig, self.options.dtype)
        return {"method": self.name, "seconds": round(seconds, 1),
                "linear_weight_bytes": tensor_bytes(tensors), "linear_fp16_bytes": float_bytes,
                "bytes_vs_fp16": round(tensor_bytes(tensors) / float_bytes, 4),
                "file_bytes": (out_dir / "model.safetensors").stat().st_size}

    def check_model(self, model: FloatLlama) -> None:
        group = getattr(self.options, "group_size", None)
        if group in (None, -1):
            return
        c = model.cfg
        for what, n in (("hidden_size", c.hidden_size), ("intermediate_size", c.intermediate_size),
                        ("num_heads * head_dim", c.num_heads * c.head_dim)):
            if n % group:
                divisors = [g for g in (256, 128, 64, 32, 16) if not (c.hidden_size % g or c.intermediate_size % g
                                                                      or (c.num_heads * c.head_dim) % g)]
                raise ConfigError(
                    f"--group-size {group} does not divide the model's {what} ({n}), the input width "
                    "of some linear layers; the published formats need whole groups"
                    + (f" (group sizes that fit: {', '.join(map(str, divisors))}, or -1)" if divisors else ""))

    def quantize_model(self, model: FloatLlama, windows: torch.Tensor | None,
                       progress: Progress) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError


def split_windows(windows: torch.Tensor) -> list[torch.Tensor]:
    return list(windows.split(CHUNK))


def flat(chunks: list[torch.Tensor]) -> torch.Tensor:
    """``[tokens, features]`` of chunks ``[b, L, features]``."""
    return torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks])


def prefix(layer: int, linear: str) -> str:
    return f"model.layers.{layer}.{linear}"
