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
def _shrink_kernel(x_ptr, a_ptr, mid_ptr, order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   d_in, kr, sx, sa0, sa1, smid,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile, rt = tl.program_id(1), tl.program_id(2)
    start, length, slot, m, rows = _segment_tile(order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M)
    if tile * BLOCK_M >= length:
        return
    r = rt * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x_ptr + rows[:, None] * sx + k[None, :], mask=(m[:, None] < length) & (k[None, :] < d_in),
                     other=0.0)
        at = tl.load(a_ptr + slot.to(tl.int64) * sa0 + r[None, :] * sa1 + k[:, None],
                     mask=(r[None, :] < kr) & (k[:, None] < d_in), other=0.0)  # [BLOCK_K, BLOCK_R]
        acc = tl.dot(xs, at, acc, input_precision=PRECISION)
    tl.store(mid_ptr + (start + m)[:, None] * smid + r[None, :], acc, mask=(m[:, None] < length) & (r[None, :] < kr))


@triton.jit
def _expand_kernel(mid_ptr, b_ptr, y_ptr, order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   d_out, kr, smid, sb0, sb1, sy,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile, nt = tl.program_id(1), tl.program_id(2)
    start, length, slot, m, rows = _segment_tile(order_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M)
    if tile * BLOCK_M >= length:
        return
    n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, kr, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mids = tl.load(mid_ptr + (start + m)[:, None] * smid + k[None, :],
                       mask=(m[:, None] < length) & (k[None, :] < kr), other=0.0)
        bt = tl.load(b_ptr + slot.to(tl.int64) * sb0 + n[None, :] * sb1 + k[:, None],
                     mask=(n[None, :] < d_out) & (k[:, None] < kr), other=0.0).to(tl.float32)
        acc = tl.dot(mids, bt, acc, input_precision=PRECISION)
    mask = (m[:, None] < length) & (n[None, :] < d_out)
    where = y_ptr + rows[:, None] * sy + n[None, :]
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
    tiles = triton.cdiv(max_len, BLOCK_M)
    block_r = max(16, min(64, triton.next_power_of_2(kr)))
    _shrink_kernel[(seg_len.shape[0], tiles, triton.cdiv(kr, block_r))](
        x, a, mid, order, seg_start, seg_len, seg_slot, d_in, kr, x.stride(0), a.stride(0), a.stride(1),
        mid.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=64, PRECISION=precision)
    block_k = max(16, min(64, triton.next_power_of_2(kr)))
    _expand_kernel[(seg_len.shape[0], tiles, triton.cdiv(d_out, 64))](
        mid, b, y, order, seg_start, seg_len, seg_slot, d_out, kr, mid.stride(0), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=block_k, PRECISION=precision)
