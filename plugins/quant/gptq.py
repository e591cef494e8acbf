"""GPTQ weight-only quantization (``quant_method: gptq``): 4- or 8-bit, any group size, act-order.

Checkpoint tensors per linear layer (FORMATS.md): ``qweight`` int32
``[in * bits / 32, out]`` packed along the input, ``qzeros`` int32
``[groups, out * bits / 32]`` packed along the output, ``scales [groups, out]``
and ``g_idx`` int32 ``[in]`` (the group of each input row; a permutation of
groups when ``desc_act``). ``W[i, o] = scales[g, o] * (q[i, o] - z[g, o])``,
``g = g_idx[i]``, ``y = x @ W``. The v1 format (``checkpoint_format: gptq``)
stores ``z - 1`` (modulo ``2**bits``); after loading, zeros are rewritten in
the v2 form once, so the reference and the kernel read one layout.
``scales`` are kept in float32 whatever the checkpoint holds (exact for fp16
and bf16). ``g_idx`` is always read, as GPTQ packers always write it.
"""

from __future__ import annotations

from typing import Literal

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
from lmplug_quant.packing import pack_cols, unpack_cols, unpack_rows, values_per_word
from pydantic import Field, field_validator

from lmplug.errors import ModelLoadError


class GPTQOptions(PackedOptions):
    bits: Literal[4, 8] = Field(default=4, description="bits per weight")
    group_size: int = Field(default=128, description="input rows per scale/zero; -1: one group")
    desc_act: bool = Field(default=False, description="act-order: g_idx permutes the groups")
    sym: bool = Field(default=True, description="symmetric quantization (informational: zeros are read)")
    checkpoint_format: Literal["gptq", "gptq_v2"] = Field(
        default="gptq", description="gptq: stored zeros are one less than the real ones; gptq_v2: as is")

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value != -1 and value <= 0:
            raise ValueError("group_size must be -1 or a positive number of input rows")
        return value


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """The dense ``W [in, out]`` (float32) of v2-format tensors."""
    q = unpack_rows(qweight, bits)  # [in, out]
    z = unpack_cols(qzeros, bits)  # [groups, out]
    g = g_idx.long()
    return (q - z[g]).float() * scales.float()[g]


class GPTQ(PackedMethod):
    name = "gptq"
    Options = GPTQOptions

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        bits, p = self.options.bits, values_per_word(self.options.bits)
        # tensor parallel, row-parallel layer: act-order groups index all input rows, so every
        # rank keeps every group's scales and zeros (``input_layout``)
        rows = getattr(layer, "full_in_features", in_features) if self.options.desc_act else in_features
        group = check_group_size(self.name, self.options.group_size, rows)
        check_divisible(self.name, "in_features", in_features, p)
        check_divisible(self.name, "out_features", out_features, p)
        groups = rows // group
        layer.qweight = int_param(in_features * bits // 32, out_features)
        layer.qzeros = int_param(groups, out_features * bits // 32)
        layer.scales = float_param(groups, out_features)
        layer.g_idx = int_param(in_features)
        make_bias(layer, out_features, dtype, bias)
        layer.act_dtype = dtype

    def shard_layout(self, layer, param_name):
        packed = {"qweight": (1, 1), "qzeros": (1, values_per_word(self.options.bits)),
                  "scales": (1, 1), "g_idx": None}
        return packed.get(param_name, (0, 1))

    def input_layout(self, layer, param_name):
        whole_groups = self.options.desc_act or self.options.group_size == -1
        group = None if whole_groups else (0, self.options.group_size)
        packed = {"qweight": (0, values_per_word(self.options.bits)), "qzeros": group, "scales": group,
                  "g_idx": (0, 1)}
        return packed.get(param_name, (1, 1))

    def normalize(self, layer):
        groups = layer.scales.shape[0]
        start = getattr(layer, "input_start", 0)
        if start and not self.options.desc_act and self.options.group_size != -1:
            layer.g_idx.data -= start // self.options.group_size  # a row-parallel slice's own groups
        g = layer.g_idx.data
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise ModelLoadError(f"quant method 'gptq': g_idx holds groups {int(g.min())}..{int(g.max())}, "
                                 f"the layer has {groups} (group_size {self.options.group_size})")
        if self.options.checkpoint_format == "gptq":
            bits = self.options.bits
            zeros = (unpack_cols(layer.qzeros.data, bits) + 1) & (2**bits - 1)
            layer.qzeros.data = pack_cols(zeros, bits)

    def extra_drop(self):
        return ("g_idx",)

    def dequantize(self, layer):
        return gptq_dequantize(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, self.options.bits)

    def kernel_args(self, layer):
        return {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales,
                "g_idx": layer.g_idx, "bits": self.options.bits, "awq_order": False}

    def int4_values(self, layer, probe=False):
        k, groups = layer.g_idx.shape[0], layer.scales.shape[0]
        if self.options.bits != 4 or k % groups:
            return None
        group = k // groups
        if not torch.equal(layer.g_idx.long(), torch.arange(k, device=layer.g_idx.device) // group):
            return None  # act-order: groups are not contiguous runs of inputs
        if probe:
            return None, None, None, group
        return unpack_rows(layer.qweight, 4), unpack_cols(layer.qzeros, 4), layer.scales, group
