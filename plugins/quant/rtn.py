"""Round-to-nearest weight-only quantization (``quant: {method: rtn}``): the baseline.

Loads an ordinary float checkpoint (``weight [out, in]``) and quantizes it
once after loading, symmetric per group of ``group_size`` input features:
``scale = max|w| / qmax`` (``qmax = 2**(bits-1) - 1``),
``q = clamp(round(w / scale), -qmax - 1, qmax)``, ``w ~ q * scale``.
int8 values are stored as int8 ``[out, in]``; int4 values as two per byte
``[out, in / 2]`` (low nibble = even column, value + 8). ``scales [out, groups]``
float32. See ``common.py`` for when the dense weight is kept instead. Not dense, on CPU, in a
bfloat16 model: torch's packed CPU matmuls (int4: ``_weight_int4pack_mm_for_cpu``, group 32-256;
int8 with ``group_size: -1``: ``_weight_int8pack_mm``), 2-3x faster than a dense bf16 matmul at
decode (``benchmarks/bench_quant_cpu.py``).
"""

from __future__ import annotations

from typing import Literal

import torch
from lmplug_quant.common import (
    WEIGHT_ONLY_CAPABILITIES,
    WeightOnlyOptions,
    check_group_size,
    dense_linear,
    int4pack,
    int4pack_linear,
    make_bias,
    replace_with_dense,
    torch_packed_problem,
    wants_dense,
)
from pydantic import Field, field_validator

from lmplug.api import QuantMethod


class RTNOptions(WeightOnlyOptions):
    bits: Literal[4, 8] = Field(default=8, description="bits per weight")
    group_size: int = Field(default=128, description="input features per scale; -1: one per row")

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value != -1 and value <= 0:
            raise ValueError("group_size must be -1 or a positive number of input features")
        return value


def rtn_quantize(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in], scales float32 [out, in / group])."""
    qmax = 2 ** (bits - 1) - 1
    w = weight.float().reshape(weight.shape[0], -1, group)  # [out, groups, group]
    scales = w.abs().amax(-1).clamp(min=1e-10) / qmax  # [out, groups]
    q = torch.round(w / scales[..., None]).clamp(-qmax - 1, qmax).to(torch.int8)
    return q.reshape(weight.shape), scales


def rtn_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q [out, in], scales [out, groups]) -> float32 [out, in]."""
    out, groups = scales.shape
    return (q.float().reshape(out, groups, -1) * scales[..., None]).reshape(q.shape)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in] -> uint8 [out, in / 2]."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).to(torch.int8) - 8


class RTN(QuantMethod):
    name = "rtn"
    capabilities = WEIGHT_ONLY_CAPABILITIES
    Options = RTNOptions

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        check_group_size(self.name, self.options.group_size, in_features)
        if self.options.bits == 4 and in_features % 2:
            check_group_size(self.name, 2, in_features)  # raises: int4 pairs need an even input
        layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                          requires_grad=False)
        make_bias(layer, out_features, dtype, bias)

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data
        group = check_group_size(self.name, self.options.group_size, weight.shape[1])
        q, scales = rtn_quantize(weight, self.options.bits, group)
        if wants_dense(self.options, uses_kernel=False):
            replace_with_dense(layer, rtn_dequantize(q, scales).to(weight.dtype), ("weight",))
            return
        del layer.weight
        if self._torch_packed(weight, group):  # torch's packed CPU matmul (bf16; see common.py)
            if self.options.bits == 4:
                layer.int4pack, layer.int4pack_scale_zeros = int4pack(
                    (q.long() + 8).T, scales.T, torch.full_like(scales.T, 8))
                layer.int4pack_group = group
            else:
                layer.int8pack, layer.int8pack_scales = q.contiguous(), scales[:, 0].to(torch.bfloat16)
            return
        layer.qweight = torch.nn.Parameter(pack_int4(q) if self.options.bits == 4 else q,
                                           requires_grad=False)
        layer.scales = torch.nn.Parameter(scales, requires_grad=False)

    def _torch_packed(self, weight: torch.Tensor, group: int) -> bool:
        """int4: ``_weight_int4pack_mm_for_cpu``; int8 with one scale per row: ``_weight_int8pack_mm``."""
        if self.options.bits == 8:
            return group == weight.shape[1] and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
        return torch_packed_problem(weight.dtype, weight.device, weight.shape[0], group) is None

    def apply(self, layer, x):
        if hasattr(layer, "weight"):
            return dense_linear(layer, x, None)
        if hasattr(layer, "int4pack"):
            return int4pack_linear(layer, x)
        if hasattr(layer, "int8pack"):
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(x2, layer.int8pack, layer.int8pack_scales)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            return (y if layer.bias is None else y + layer.bias).to(x.dtype)
        q = unpack_int4(layer.qweight) if self.options.bits == 4 else layer.qweight
        return dense_linear(layer, x, rtn_dequantize(q, layer.scales).T)
