"""FP8 W8A8 (``quant_method: fp8``): e4m3 weights and activations, float32 scales.

Checkpoints (FORMATS.md "FP8"):

- HF / DeepSeek-V3 block format (``weight_block_size: [128, 128]``): ``weight``
  fp8 ``[out, in]`` and ``weight_scale_inv`` float32 ``[ceil(out/128),
  ceil(in/128)]``, which despite its name multiplies; activations are quantized
  dynamically per token and per 128 inputs.
- vLLM's per-tensor format (no block size): ``weight`` fp8 and a scalar
  ``weight_scale``; ``activation_scheme: static`` adds a scalar ``input_scale``,
  ``dynamic`` quantizes per token.

``quant: {method: fp8}`` on a float checkpoint quantizes the weights at load
time (per channel unless ``weight_strategy`` says otherwise). Layers named in
``modules_to_not_convert`` (HF) / ``ignored_layers`` (vLLM) stay in float. The
math and the paths are ``w8a8_common``'s.
"""

from __future__ import annotations

from typing import Literal

from lmplug_quant.w8a8_common import CheckpointW8A8Options, W8A8Linear, W8A8Scheme, match_name
from pydantic import Field, field_validator, model_validator

from lmplug.api import Unquantized
from lmplug.errors import ModelLoadError


class FP8Options(CheckpointW8A8Options):
    weight_block_size: list[int] | None = Field(
        default=None, description="[rows, columns] of a weight scale block (DeepSeek-V3: [128, 128])")
    weight_strategy: Literal["tensor", "channel", "block"] | None = Field(
        default=None, description="weight scales; default: block with weight_block_size, else "
        "tensor for an fp8 checkpoint and channel when quantizing at load")
    modules_to_not_convert: list[str] = Field(
        default_factory=list, description="layers left in float: a layer matches when its "
        "checkpoint name contains an entry (e.g. lm_head, model.layers.0.mlp)")

    @field_validator("weight_block_size")
    @classmethod
    def _block(cls, value):
        if value is not None and (len(value) != 2 or min(value) <= 0):
            raise ValueError("weight_block_size must be two positive sizes [rows, columns]")
        return value

    @field_validator("modules_to_not_convert", mode="before")
    @classmethod
    def _none_is_empty(cls, value):
        return [] if value is None else value

    @model_validator(mode="after")
    def _consistent(self):
        if (self.weight_strategy == "block") != (self.weight_block_size is not None) \
                and self.weight_strategy is not None:
            raise ValueError("weight_strategy block goes with weight_block_size, and only it")
        if self.activation_scheme == "static" and self.weight_block_size is not None:
            raise ValueError("block-scaled fp8 quantizes activations dynamically (activation_scheme dynamic)")
        return self


class FP8(W8A8Linear):
    name = "fp8"
    Options = FP8Options

    @classmethod
    def from_checkpoint_config(cls, quantization_config):
        config = dict(quantization_config)
        ignored = list(config.get("modules_to_not_convert") or []) + list(config.get("ignored_layers") or [])
        config["modules_to_not_convert"] = ignored
        config["quantized_checkpoint"] = True
        return cls.Options(**{k: v for k, v in config.items() if k in cls.Options.model_fields})

    def make_scheme(self, options: FP8Options) -> W8A8Scheme:
        block = tuple(options.weight_block_size) if options.weight_block_size else None
        strategy = options.weight_strategy or (
            "block" if block else "tensor" if options.quantized_checkpoint else "channel")
        act = "static" if options.activation_scheme == "static" else "group" if block else "token"
        return W8A8Scheme(kind="fp8", weight_strategy=strategy, act=act, block=block,
                          act_group=block[1] if block else 0, serialized=options.quantized_checkpoint,
                          scale_name="weight_scale_inv" if block else "weight_scale", method=self.name)

    def method_for_layer(self, prefixes):
        skipped = [match_name(p, self.options.modules_to_not_convert) for p in prefixes]
        if all(skipped):
            return Unquantized()
        if any(skipped):
            raise ModelLoadError(f"quant method 'fp8': modules_to_not_convert leaves some pieces of one "
                                 f"fused layer in float but not others ({', '.join(prefixes)})")
        return self
