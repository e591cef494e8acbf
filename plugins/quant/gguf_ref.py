"""The PyTorch reference for GGUF's packed weights: dequantize blocks, then ``F.linear``.

Each function reproduces gguf-py's numpy ``dequantize`` (llama.cpp's ``dequantize_row_*``)
operation for operation in float32, so the result is bit-identical to it (the tests hold it
to that). It runs on the bytes as they lie in the file, per call: slow, but no float copy of
a weight outlives the call. It is the fallback where the native kernel does not run and the
ground truth the kernel is tested against.

Block layouts (ggml-common.h), bytes per block of 32 (``_0``/``_1``/``Q8_0``) or 256 (k-quants):
Q4_0 ``d:f16, qs[16]``; Q4_1 ``d:f16, m:f16, qs[16]``; Q5_0 ``d:f16, qh:u32, qs[16]``;
Q5_1 ``d:f16, m:f16, qh:u32, qs[16]``; Q8_0 ``d:f16, qs:int8[32]``;
Q3_K ``hmask[32], qs[64], scales[12], d:f16``; Q4_K ``d:f16, dmin:f16, scales[12], qs[128]``; Q5_K ``d, dmin, scales[12], qh[32], qs[128]``;
Q6_K ``ql[128], qh[64], scales:int8[16], d:f16``;
IQ4_NL ``d:f16, qs[16]`` (each nibble an index into ``KVALUES_IQ4NL``); IQ4_XS (256)
``d:f16, scales_h:u16, scales_l[4], qs[128]`` (8 sub-blocks of 32 as IQ4_NL, 6-bit scales minus 32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from lmplug.api import BLOCK_SIZES


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float16 at byte ``offset`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """Bytes in chunks of ``chunk``: each chunk's low nibbles, then its high nibbles."""
    q = qs.reshape(qs.shape[0], -1, 1, chunk)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(qs.shape[0], -1, chunk)


# ggml's kvalues_iq4nl: the 16 values a 4-bit IQ4_NL / IQ4_XS index stands for
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_values(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """IQ4 nibbles (chunks of 16 bytes: low nibbles, then high) -> their table values, float32."""
    table = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=qs.device)
    return table[_nibbles(qs, chunk).long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _iq4_values(b[:, 2:], 16).reshape(b.shape[0], 32)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sub = torch.arange(8, device=b.device)
    low = (b[:, 4 + sub // 2] >> (4 * (sub % 2)).to(torch.uint8)) & 0x0F
    high = (b[:, 2:4].contiguous().view(torch.int16).long() >> (2 * sub)) & 3  # scales_h: 2 bits a sub-block
    ls = (low.long() | (high << 4)) - 32
    dl = (_f16(b, 0) * ls.float()).unsqueeze(2)  # [n, 8, 1]
    return (dl * _iq4_values(b[:, 8:], 16).reshape(n, 8, 32)).reshape(n, 256)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).to(torch.int8) - 8).float()
    return _f16(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _five_bits(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1: the 32 values of a block, 0..31 (bit e of the 32-bit ``qh`` at ``at`` is bit
    4 of value e; the nibbles follow it)."""
    low = _nibbles(b[:, at + 4:], 16).reshape(b.shape[0], 32)
    qh = b[:, at:at + 4].long()
    bits = torch.arange(32, device=b.device)
    high = (qh[:, bits // 8] >> (bits % 8)) & 1
    return low | (high << 4).to(torch.uint8)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_five_bits(b, 2).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _five_bits(b, 4).float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: eight 6-bit scales and mins packed in 12 bytes (``get_scale_min_k4``)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, mn = _scale_min_k4(b[:, 4:16])
    return (_f16(b, 0) * sc).unsqueeze(2), (_f16(b, 2) * mn).unsqueeze(2)  # [n, 8, 1] each


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k4_scales(b)
    q = _nibbles(b[:, 16:], 32).float()  # [n, 8, 32]
    return (d * q - dm).reshape(b.shape[0], 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k4_scales(b)
    low = _nibbles(b[:, 48:], 32)  # [n, 8, 32]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    high = (b[:, 16:48].reshape(b.shape[0], 1, 32) >> shifts) & 0x01  # bit j of qh: sub-block j
    q = (low | (high << 4)).float()
    return (d * q - dm).reshape(b.shape[0], 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 96:108]
    low = torch.stack([sc[:, :8] & 0x0F, sc[:, :8] >> 4], 1).reshape(n, 16)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 4, 1)
    high = ((sc[:, 8:12].reshape(n, 1, 4) >> shifts) & 0x03).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(b, 108) * scales).reshape(n, 16, 1)
    ql = (b[:, 32:96].reshape(n, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & 0x03  # [n, 2, 4, 32]
    bits = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    qh = ((b[:, :32].reshape(n, 1, 32) >> bits) & 0x01) ^ 0x01  # 1: the value is 4 lower
    q = (ql.reshape(n, 8, 32).to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q.reshape(n, 16, 16)).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(2)  # [n, 16, 1]
    low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


_BLOCKS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k,
           Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}
FLOAT_TYPES = frozenset({int(Q.F32), int(Q.F16), int(Q.BF16)})
# what ``dequantize`` reads; any other type the gguf method dequantizes once at load
SUPPORTED = frozenset(int(t) for t in _BLOCKS) | FLOAT_TYPES


def dequantize(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """uint8 ``[rows, row_bytes]`` of ``ggml_type`` -> float32 ``[rows, cols]``."""
    rows = data.shape[0]
    if ggml_type in FLOAT_TYPES:  # little-endian bytes of the float type itself
        kind = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[Q(ggml_type)]
        return data.contiguous().view(kind).reshape(rows, cols).float()
    block, size = BLOCK_SIZES[ggml_type]
    blocks = data.reshape(rows * (cols // block), size)
    return _BLOCKS[Q(ggml_type)](blocks).reshape(rows, cols)


def linear(x: torch.Tensor, data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """``x [M, cols] @ W.T`` in float32, ``W`` dequantized from ``data`` for this call only."""
    return F.linear(x.float(), dequantize(data, ggml_type, cols))
