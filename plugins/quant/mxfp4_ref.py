"""MXFP4 (OCP Microscaling Formats v1.0): the PyTorch reference the kernels are tested against.

A block is 32 FP4 E2M1 values sharing one E8M0 scale. HF checkpoints (``quant_method: mxfp4``,
GPT-OSS's experts) store a weight ``[out, in]`` as ``blocks`` uint8 ``[out, in / 32, 16]``, two
values a byte, element ``2j`` in the low nibble and ``2j + 1`` in the high one, and ``scales``
uint8 ``[out, in / 32]``. Element value: ``fp4(nibble) * 2 ** (scale - 127)``; an E2M1 nibble is
sign (bit 3), exponent (bits 2-1, bias 1) and mantissa (bit 0): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives; scale 255 is NaN (the format's only special value).

llama.cpp's GGUF files (ggml type ``MXFP4``, ``block_mxfp4`` in ggml-common.h) hold the same values
in 17-byte blocks: the E8M0 byte ``e``, then 16 bytes ``qs`` with element ``j`` in the low nibble of
``qs[j]`` and ``j + 16`` in its high one (ggml's table doubles the E2M1 values and halves the scale:
the same product). ``from_ggml`` repacks them into the layout above, bytes only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # values per block
BLOCK_BYTES = BLOCK // 2
SCALE_BIAS = 127
SCALE_NAN = 255
GGML_BLOCK_BYTES = 1 + BLOCK_BYTES  # block_mxfp4: e, qs[16]
_GGML_CHUNK_ROWS = 4096  # rows repacked at a time: bounds the temporaries
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check(blocks: torch.Tensor, scales: torch.Tensor, in_features: int | None = None) -> None:
    """ValueError unless ``blocks [..., G, 16]`` and ``scales [..., G]`` are uint8 and agree
    (and cover ``in_features`` when given)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not agree: "
                         f"blocks must be [..., G, {BLOCK_BYTES}] for scales [..., G]")
    if in_features is not None and scales.shape[-1] * BLOCK != in_features:
        raise ValueError(f"MXFP4: {scales.shape[-1]} blocks of {BLOCK} a row do not cover {in_features} input features")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., G, 16]``, ``scales [..., G]`` -> ``[..., G * 32]`` in ``dtype`` (exact in float32:
    every value is a small integer times a power of two)."""
    check(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # element 2j (low nibble), then 2j + 1
    exponent = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponent.unsqueeze(-1))
    out = torch.where((scales == SCALE_NAN).unsqueeze(-1), torch.tensor(float("nan"), device=out.device), out)
    return out.flatten(-2).to(dtype)


def linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, in] @ dequantize(blocks, scales)^T (+ bias)`` in x's dtype (dequantized per call)."""
    return F.linear(x, dequantize(blocks, scales, x.dtype), bias)


def from_ggml(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml ``block_mxfp4`` rows (uint8 ``[rows, G * 17]``) -> ``blocks [rows, G, 16]``, ``scales
    [rows, G]`` (new tensors; ``data`` may be a read-only file mapping). ValueError for a row that
    is not whole blocks, or a scale byte of 255: ggml reads it as 2^128, OCP as NaN."""
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % GGML_BLOCK_BYTES:
        raise ValueError(f"ggml MXFP4 rows must be uint8 [rows, blocks * {GGML_BLOCK_BYTES}], got "
                         f"{data.dtype} {tuple(data.shape)}")
    rows, groups = data.shape[0], data.shape[1] // GGML_BLOCK_BYTES
    blocks = torch.empty(rows, groups, BLOCK_BYTES, dtype=torch.uint8, device=data.device)
    scales = torch.empty(rows, groups, dtype=torch.uint8, device=data.device)
    for start in range(0, rows, _GGML_CHUNK_ROWS):
        raw = data[start:start + _GGML_CHUNK_ROWS].reshape(-1, groups, GGML_BLOCK_BYTES)
        scales[start:start + raw.shape[0]] = raw[..., 0]
        qs = raw[..., 1:]
        values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [n, G, 32]: element order
        blocks[start:start + raw.shape[0]] = values[..., 0::2] | (values[..., 1::2] << 4)
    if bool((scales == SCALE_NAN).any()):
        raise ValueError(f"holds an MXFP4 scale byte of {SCALE_NAN}, which ggml reads as 2^128 and the OCP "
                         "format as NaN; no quantizer writes it for finite weights")
    return blocks, scales
