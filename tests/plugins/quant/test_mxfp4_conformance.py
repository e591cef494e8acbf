"""The ``mxfp4`` quant method through the quant conformance suite: checkpoint layout, round trip
and matmul against a packer and an unpacker written here from the OCP MX v1.0 description (shared
exponent ``floor(log2(amax)) - 2``, E2M1's largest exponent; each value rounded to the nearest FP4
value, ties to the even mantissa; element 2j in a byte's low nibble)."""

from __future__ import annotations

from typing import ClassVar

import torch

from lmplug.testing import QuantConformance

FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ocp_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    out_f, in_f = weight.shape
    blocks = weight.double().reshape(out_f, in_f // 32, 32)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-300))) - 2, torch.zeros_like(amax))
    scaled = (blocks / torch.exp2(exp).unsqueeze(-1)).clamp(-6, 6)
    dist = (scaled.abs().unsqueeze(-1) - FP4_GRID.double()).abs()  # [..., 32, 8]
    # nearest grid value; on a tie the even code (mantissa bit 0), as round-half-to-even
    code = (dist + 1e-12 * (torch.arange(8) % 2)).argmin(-1)
    nibble = (code | ((scaled < 0) & (code > 0)).long() * 8).to(torch.uint8)
    packed = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return {"blocks": packed.contiguous(), "scales": (exp + 127).to(torch.uint8)}


def ocp_unpack(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    blocks, scales = tensors["blocks"].long(), tensors["scales"].double()
    nibbles = torch.stack([blocks & 15, blocks >> 4], -1).flatten(-2)  # [out, G, 32]
    magnitude = FP4_GRID.double()[nibbles & 7]
    values = torch.where(nibbles & 8 > 0, -magnitude, magnitude) * torch.exp2(scales - 127).unsqueeze(-1)
    return values.flatten(1).float()


class MXFP4Case(QuantConformance):
    backend = "mxfp4"
    max_weight_error = 0.2  # 4-bit floats: about 12 % of a Gaussian block's norm
    checkpoint_config: ClassVar[dict] = {"quant_method": "mxfp4"}

    def checkpoint_tensors(self, in_features, out_features):
        return {"blocks": ((out_features, in_features // 32, 16), torch.uint8),
                "scales": ((out_features, in_features // 32), torch.uint8)}

    def quantize(self, weight):
        return ocp_pack(weight)

    def dequantize(self, tensors):
        return ocp_unpack(tensors)


class TestMXFP4Native(MXFP4Case):
    options: ClassVar[dict] = {"kernel": "auto"}


class TestMXFP4Torch(MXFP4Case):
    options: ClassVar[dict] = {"kernel": "torch"}
