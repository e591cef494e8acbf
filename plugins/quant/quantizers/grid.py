"""Integer grids: per-row min/max scales and zero points, quantize, dequantize (GPTQ's quantizer).

``W ≈ scale * (q - zero)`` with ``q`` in ``0 .. 2**bits - 1``. Symmetric grids
put the zero at ``2**(bits-1)`` and the scale at ``2 * max|w| / (2**bits - 1)``
(GPTQ's ``sym``); asymmetric ones span ``[min(w, 0), max(w, 0)]`` with an
integer zero (AWQ and GPTQ ``sym: false``). Scales are rounded to float16
first, as the checkpoint stores them, so what a quantizer computes with is
exactly what an engine reads back.
"""

from __future__ import annotations

import torch


def grid_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` per row of ``w [rows, n]``, float32 (zero integer-valued)."""
    maxq = 2**bits - 1
    zero_t = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    xmin, xmax = torch.minimum(w.min(1).values, zero_t), torch.maximum(w.max(1).values, zero_t)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
    scale = ((xmax - xmin) / maxq).half().float()
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0**-24))  # fp16 underflow
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers ``q`` (int32) of ``w [rows, n]`` on the grid of each row."""
    q = torch.round(w / scale[:, None]) + zero[:, None]
    return q.clamp(0, 2**bits - 1).to(torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale[:, None] * (q.float() - zero[:, None])


def fake_quantize(w: torch.Tensor, bits: int, sym: bool) -> torch.Tensor:
    """``w`` rounded to its rows' grids."""
    scale, zero = grid_params(w, bits, sym)
    return dequantize(quantize(w, scale, zero, bits), scale, zero)


def quantize_groups(w: torch.Tensor, bits: int, group_size: int, sym: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of ``w [out, in]`` in groups of ``group_size`` input columns.
    Returns ``q [out, in]`` int32, ``scales [groups, out]``, ``zeros [groups, out]``."""
    out, n = w.shape
    g = n if group_size == -1 else group_size
    rows = w.reshape(out, n // g, g).transpose(0, 1).reshape(-1, g)  # [(groups, out), g]
    scale, zero = grid_params(rows, bits, sym)
    q = quantize(rows, scale, zero, bits).reshape(n // g, out, g).transpose(0, 1).reshape(out, n)
    return q, scale.reshape(n // g, out), zero.reshape(n // g, out)


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      g_idx: torch.Tensor) -> torch.Tensor:
    """``W [out, in]`` from ``q [out, in]`` and per-group ``scales``/``zeros [groups, out]``;
    ``g_idx [in]``: the group of each input column."""
    g = g_idx.long()
    return (q.float() - zeros.T[:, g]) * scales.T[:, g]


def fake_quantize_int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8 activations (the A8 of W8A8), as a kernel would see them."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(x / scale).clamp(-127, 127) * scale


def fake_quantize_fp8_tokens(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token float8 e4m3 activations."""
    scale = (x.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale
