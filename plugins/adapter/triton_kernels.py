"""Segment-grouped LoRA kernels (Punica's SGMV): a step's tokens sorted by adapter slot, one
program per (segment tile, output tile).

shrink: ``mid[i] = a[slot] @ x[order[i]]`` for the i-th token of the sorted order, [N, K*R] fp32;
expand: ``y[order[i]] += b[slot] @ mid[i]``. Each y row belongs to one token, so each element is
written by one program (no atomics). fp32 inputs multiply in IEEE fp32 (never tf32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens of one segment per program (tl.dot's minimum tile)


@triton.jit
def _segment_tile(order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M: tl.constexpr):
    """This program's segment (program id 0) and token tile (id 1): its start in the sorted order,
    length, slot, the tile's positions in the segment and their token rows."""
    seg, tile = tl.program_id(0), tl.program_id(1)
    start, length, slot = tl.load(seg_start_ptr + seg), tl.load(seg_len_ptr + seg), tl.load(seg_slot_ptr + seg)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(order_ptr + start + m, mask=m < length, other=0)
    return start, length, slot, m, rows


@triton.jit
def _segment_gemm_kernel(in_ptr, w_ptr, out_ptr, order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                         d_in, d_out, s_in, sw0, sw1, s_out, SHRINK: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    """``out[o] (+)= w[slot] @ in[i]`` over a segment tile. SHRINK: ``in`` rows are the tokens
    (``order``), ``out`` rows the sorted positions, stored; otherwise the reverse, added."""
    tile, nt = tl.program_id(1), tl.program_id(2)
    start, length, slot, m, rows = _segment_tile(order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M)
    if tile * BLOCK_M >= length:
        return
    in_rows = rows if SHRINK else start + m
    out_rows = start + m if SHRINK else rows
    n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(in_ptr + in_rows[:, None] * s_in + k[None, :],
                     mask=(m[:, None] < length) & (k[None, :] < d_in), other=0.0)
        wt = tl.load(w_ptr + slot.to(tl.int64) * sw0 + n[None, :] * sw1 + k[:, None],
                     mask=(n[None, :] < d_out) & (k[:, None] < d_in), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(xs, wt.to(xs.dtype), acc, input_precision=PRECISION)
    mask = (m[:, None] < length) & (n[None, :] < d_out)
    where = out_ptr + out_rows[:, None] * s_out + n[None, :]
    if SHRINK:
        tl.store(where, acc, mask=mask)
    else:
        old = tl.load(where, mask=mask, other=0.0)
        tl.store(where, (old.to(tl.float32) + acc).to(old.dtype), mask=mask)


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, order: torch.Tensor,
         seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor, max_len: int) -> None:
    """``y[order[i]] += b[s] @ (a[s] @ x[order[i]])`` over each segment (start, length, slot s)
    of the sorted token order; ``y`` in place."""
    kr, d_in, d_out = a.shape[1], a.shape[2], b.shape[1]
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    if y.stride(1) != 1:
        raise ValueError("sgmv: y's rows must be dense")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    mid = torch.empty(order.shape[0], kr, dtype=torch.float32, device=x.device)
    tiles, segments = triton.cdiv(max_len, BLOCK_M), seg_len.shape[0]
    block_r = max(16, min(64, triton.next_power_of_2(kr)))
    _segment_gemm_kernel[(segments, tiles, triton.cdiv(kr, block_r))](
        x, a, mid, order, seg_start, seg_len, seg_slot, d_in, kr, x.stride(0), a.stride(0), a.stride(1),
        mid.stride(0), SHRINK=True, BLOCK_M=BLOCK_M, BLOCK_N=block_r, BLOCK_K=64, PRECISION=precision)
    _segment_gemm_kernel[(segments, tiles, triton.cdiv(d_out, 64))](
        mid, b, y, order, seg_start, seg_len, seg_slot, kr, d_out, mid.stride(0), b.stride(0), b.stride(1),
        y.stride(0), SHRINK=False, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=block_r, PRECISION=precision)
