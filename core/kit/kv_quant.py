"""Quantized KV (``kvcache: {dtype: int8 | fp8_e4m3}``): the one definition every KV and
attention backend writes and reads with (symmetric, dynamic, one float32 scale per (token,
KV head) vector; see ``lmplug.interfaces.kvcache``)."""

from __future__ import annotations

import torch

# the largest magnitude each storage dtype holds: amax maps onto it
KV_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] in ``dtype``, scale [...] float32), per vector over the last dim.

    int8 rounds to nearest (error <= scale / 2 = amax / 254); e4m3 rounds to nearest by the
    cast (relative error <= 2^-4). An all-zero vector gets scale 0 and stores zeros.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1) / KV_QMAX[dtype]
    y = x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    if dtype == torch.int8:
        q = y.round().clamp_(-127, 127).to(torch.int8)
    else:
        q = y.clamp_(-448.0, 448.0).to(dtype)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [..., D], scale [...]) -> [..., D] in ``dtype``: ``q * scale`` in float32, then cast.

    The Triton kernels dequantize a loaded tile in the same order, so an attention backend
    fed ``dequantize_kv`` of its cache reproduces its own quantized result exactly.
    """
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    # CPU index_copy_ has no float8 kernel; a byte view copies the same bits
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def store_kv(cache: torch.Tensor, scale_cache: torch.Tensor | None, x: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write x [T, Hkv, D] into slots ``slot_mapping`` of cache [..., Hkv, D] (flattened to slots),
    quantizing it (and storing its scales in ``scale_cache`` [..., Hkv]) when the cache is quantized."""
    if scale_cache is None:
        cache.view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, x)
        return
    q, scale = quantize_kv(x, cache.dtype)
    _bytes_view(cache).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, _bytes_view(q))
    scale_cache.view(-1, x.shape[1]).index_copy_(0, slot_mapping, scale)
