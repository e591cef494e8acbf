"""What every offline quantizer shares: options, the float model, calibration windows, writing.

A method implements ``quantize_model(model, windows, progress) ->
(tensors, quantization_config)``: ``model`` is the float decoder
(``reference.FloatLlama``; for methods without calibration the weights alone,
``weights.DecoderWeights``) whose tensors it may rewrite in place (folded
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
from lmplug_quant.quantizers.reference import FloatLlama
from lmplug_quant.quantizers.weights import DecoderWeights, float_model
from lmplug_quant.quantizers.writer import float_tensors, tensor_bytes, write_checkpoint
from pydantic import Field, field_validator

from lmplug.api import (
    BackendOptions,
    CalibrationSpec,
    Capabilities,
    ModelSource,
    Progress,
    Quantizer,
)
from lmplug.errors import ConfigError

CHUNK = 4  # calibration windows per forward (bounds the attention scores' memory)
GROUP_CHOICES = (128, 64, 32)  # the default group size: the largest of these that fits the model


class QuantizerOptions(BackendOptions):
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        default="float16", description="dtype of the tensors left in floating point (embeddings, "
        "norms, biases) and of the scales")


class GroupOptions(QuantizerOptions):
    # 4, not the load-time `quant: rtn` default of 8: this writes the GPTQ format, whose common
    # (and smallest) case is 4-bit; the summary printed at the end names the bits written
    bits: Literal[4, 8] = Field(default=4, description="bits per weight")
    group_size: int | None = Field(
        default=None, description="input columns per scale/zero; -1: one group per row; default: the "
        "largest of 128, 64, 32 that divides the input width of every quantized layer")

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value <= 0:
            raise ValueError("group_size must be -1 or a positive number of input columns")
        return value


class BaseQuantizer(Quantizer):
    capabilities = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}))
    Options: ClassVar[type[BackendOptions]] = QuantizerOptions

    def quantize(self, model_source: ModelSource, out_dir: Path, calibration: CalibrationSpec,
                 progress: Progress) -> dict:
        started = time.perf_counter()
        model = float_model(model_source, self.needs_calibration, calibration.seq_len)
        self.check_model(model)
        windows = calibration_windows(model_source.tokenizer, calibration) if self.needs_calibration else None
        tensors, qconfig = self.quantize_model(model, windows, progress)
        seconds = time.perf_counter() - started
        chosen = {k: getattr(self.options, k) for k in ("bits", "group_size") if hasattr(self.options, k)}
        linear_weights = {f"model.layers.{i}.{name}.weight"
                          for i in range(model.cfg.num_layers) for name in model.linears}
        float_bytes = 2 * sum(model.tensors[k].numel() for k in linear_weights)
        out = {**float_tensors(model.tensors, linear_weights, self.options.dtype), **tensors}
        write_checkpoint(out_dir, model_source, out, qconfig, self.options.dtype)
        return {"method": self.name, **chosen, "seconds": round(seconds, 1),
                "linear_weight_bytes": tensor_bytes(tensors), "linear_fp16_bytes": float_bytes,
                "bytes_vs_fp16": round(tensor_bytes(tensors) / float_bytes, 4),
                "file_bytes": (out_dir / "model.safetensors").stat().st_size}

    def check_model(self, model: FloatLlama | DecoderWeights) -> None:
        """The group size divides every quantized layer's input width; when none was given, the
        largest of ``GROUP_CHOICES`` that does (set on ``self.options``)."""
        if "group_size" not in type(self.options).model_fields or self.options.group_size == -1:
            return
        c = model.cfg
        widths = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                  "num_heads * head_dim": c.num_heads * c.head_dim}
        fit = [g for g in (256, *GROUP_CHOICES, 16) if all(n % g == 0 for n in widths.values())]
        hint = f" (group sizes that fit: {', '.join(map(str, fit))}, or -1)" if fit else " (pass --group-size -1)"
        group = self.options.group_size
        if group is None:
            group = next((g for g in GROUP_CHOICES if g in fit), None)
            if group is None:
                raise ConfigError(
                    f"--group-size: none of {', '.join(map(str, GROUP_CHOICES))} divides the model's input "
                    f"widths ({', '.join(f'{k} {n}' for k, n in widths.items())}); give one{hint}")
            self.options = self.options.model_copy(update={"group_size": group})
            return
        for what, n in widths.items():
            if n % group:
                raise ConfigError(
                    f"--group-size {group} does not divide the model's {what} ({n}), the input width "
                    f"of some linear layers; the published formats need whole groups{hint}")

    def quantize_model(self, model: FloatLlama | DecoderWeights, windows: torch.Tensor | None,
                       progress: Progress) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError


def split_windows(windows: torch.Tensor) -> list[torch.Tensor]:
    return list(windows.split(CHUNK))


def flat(chunks: list[torch.Tensor]) -> torch.Tensor:
    """``[tokens, features]`` of chunks ``[b, L, features]``."""
    return torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks])


def prefix(layer: int, linear: str) -> str:
    return f"model.layers.{layer}.{linear}"
