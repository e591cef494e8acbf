"""AWQ weight-only quantization (``quant_method: awq``, GEMM version): 4-bit, zero points.

Checkpoint tensors per linear layer (FORMATS.md): ``qweight`` int32
``[in, out / 8]`` and ``qzeros`` int32 ``[in / G, out / 8]``, both packed along
the output with AWQ's interleave (nibble ``k`` holds column ``[0, 2, 4, 6, 1,
3, 5, 7][k]`` of its eight), and ``scales [in / G, out]``.
``W[i, o] = (q[i, o] - z[g, o]) * s[g, o]`` with ``g = i // G``; zeros are
stored as is. ``scales`` are kept in float32.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from lmplug_quant.common import (
    PackedMethod,
    PackedOptions,
    check_divisible,
    check_group_size,
    float_param,
    int_param,
    make_bias,
)
from lmplug_quant.packing import AWQ_ORDER, unpack_cols
from pydantic import Field, field_validator

# checkpoint key -> option (AutoAWQ writes w_bit / q_group_size in quant_config.json)
ALIASES = {"w_bit": "bits", "q_group_size": "group_size"}


class AWQOptions(PackedOptions):
    bits: Literal[4] = Field(default=4, description="bits per weight (the GEMM format is 4-bit)")
    group_size: int = Field(default=128, description="input rows per scale/zero; -1: one group")
    zero_point: Literal[True] = Field(default=True, description="asymmetric with zero points (required)")
    version: Literal["gemm"] = Field(default="gemm", description="packing version (GEMM only)")

    @field_validator("version", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """The dense ``W [in, out]`` (float32) of AWQ GEMM tensors."""
    q = unpack_cols(qweight, 4, AWQ_ORDER)  # [in, out]
    z = unpack_cols(qzeros, 4, AWQ_ORDER)  # [groups, out]
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return (q - z[g]).float() * scales.float()[g]


class AWQ(PackedMethod):
    name = "awq"
    Options = AWQOptions
    PACKED: ClassVar[dict[str, tuple[int, int] | None]] = {"qweight": (1, 8), "qzeros": (1, 8), "scales": (1, 1)}

    @classmethod
    def from_checkpoint_config(cls, quantization_config):
        renamed = {ALIASES.get(k, k): v for k, v in quantization_config.items()}
        return super().from_checkpoint_config(renamed)

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        group = check_group_size(self.name, self.options.group_size, in_features)
        check_divisible(self.name, "out_features", out_features, 8)
        groups = in_features // group
        layer.qweight = int_param(in_features, out_features // 8)
        layer.qzeros = int_param(groups, out_features // 8)
        layer.scales = float_param(groups, out_features)
        make_bias(layer, out_features, dtype, bias)
        layer.act_dtype = dtype
        layer.group_rows = group

    def input_layout(self, layer, param_name):
        group = None if self.options.group_size == -1 else (0, self.options.group_size)
        return {"qweight": (0, 1), "qzeros": group, "scales": group}.get(param_name, (1, 1))

    def normalize(self, layer):
        # the kernel reads one group index per input row, as for GPTQ
        rows = torch.arange(layer.qweight.shape[0], dtype=torch.int32, device=layer.qweight.device)
        layer.register_buffer("g_idx", rows // layer.group_rows, persistent=False)

    def extra_drop(self):
        return ("g_idx",)

    def dequantize(self, layer):
        return awq_dequantize(layer.qweight, layer.qzeros, layer.scales, layer.group_rows)

    def kernel_args(self, layer):
        return {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales,
                "g_idx": layer.g_idx, "bits": 4, "awq_order": True}

    def int4_values(self, layer, probe=False):
        if probe:
            return None, None, None, layer.group_rows
        return (unpack_cols(layer.qweight, 4, AWQ_ORDER), unpack_cols(layer.qzeros, 4, AWQ_ORDER),
                layer.scales, layer.group_rows)
