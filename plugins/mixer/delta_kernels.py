"""The gated delta rule in Triton: the launchers ``chunk_gated_delta_rule`` (prefill) and
``fused_recurrent_gated_delta_rule_update`` (decode).

Same arguments, results and math as ``delta_ref`` (read its docstring for the recurrence and the
chunked WY / UT-transform form); everything past the loads is fp32, whatever the input dtype. Here:
the argument checks, the fp32 scratch buffers (``W``, ``U``, ``F`` and ``h``, the latter
``T // CHUNK + B`` states: a bound on the chunk count that needs no read-back of ``cu_seqlens``),
each chunk's bounds, and the launch sizes. The kernels, and why prefill is three launches, are
``delta_jit.py``.
"""

from __future__ import annotations

import torch
import triton
from lmplug_mixer.delta_jit import output_kernel, state_kernel, step_kernel, wy_kernel
from lmplug_mixer.delta_ref import check_gated_delta, check_state

from lmplug.kit.triton_launch import DTYPES, check_power_of_two, dot_precision, head_dim_pad

MAX_HEAD_DIM = 256  # the decode kernel holds a head's keys as one tile of head_dim_pad lanes
# prefill launch sizes; at chunk 64 the largest uses 170 registers a thread (fp32 WY, 8 warps)
LANE_TILE = 16  # key / value lanes per product step of the WY and output kernels
STATE_TILE = 32  # state rows per product step of the state pass
BLOCK_V = 32  # state columns per program of the state pass
# state columns per program of decode: 32 spills 8 B on sm_80 in 16-bit under Triton 3.6.0; 16 none
STEP_BLOCK_V = 16
OUT_BLOCK_V = 32  # output columns per program of the output kernel
WY_WARPS, STATE_WARPS, OUT_WARPS = 8, 4, 4


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           what: str) -> int:
    group = check_gated_delta(q, k, v, g, beta, what)
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{what}: q, k, v must share one dtype of float32, float16, bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if any(x.device != q.device for x in (k, v, g, beta)):
        raise ValueError(f"{what}: q, k, v, g, beta must be on one device")
    if q.shape[2] > MAX_HEAD_DIM or v.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"{what}: head dims up to {MAX_HEAD_DIM}; got Dk {q.shape[2]}, Dv {v.shape[2]}")
    return group


def _rows(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Row-major copies where needed: the kernels take strides for every dim but the last ones."""
    return [x if x.is_contiguous() else x.contiguous() for x in xs]


def _block_v(head_v: int, block_v: int | None, what: str, default: int = BLOCK_V) -> int:
    block = block_v or min(default, head_dim_pad(head_v))
    check_power_of_two(block, "block_v", what)
    return block


def _chunk_bounds(cu_seqlens: torch.Tensor, chunk_size: int,
                  tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first token, sequence end) of every chunk of every sequence, int64 [tokens // chunk_size + B]
    (a bound on the chunk count known without reading ``cu_seqlens`` back; spare entries are (0, 0),
    chunks without tokens), and each sequence's first chunk, int64 [B]."""
    cu = cu_seqlens.long()
    batch = cu.shape[0] - 1
    counts = (cu.diff() + chunk_size - 1) // chunk_size
    ends = counts.cumsum(0)  # one past each sequence's last chunk
    ids = torch.arange(tokens // chunk_size + batch, device=cu.device)
    seq = torch.searchsorted(ends, ids, right=True)
    used = seq < batch
    seq = seq.clamp(max=batch - 1)
    bos = cu[seq] + (ids - ends[seq] + counts[seq]) * chunk_size
    return torch.where(used, bos, 0), torch.where(used, cu[seq + 1], 0), ends - counts


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor,
                           initial_state: torch.Tensor | None = None, chunk_size: int = 64,
                           use_qk_l2norm: bool = True, scale: float | None = None, *,
                           block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g (log-decay), beta [T, Hv], cu_seqlens [B+1] (int32/int64),
    initial_state (fp32 [B, Hv, Dk, Dv], None: zeros) -> (o [T, Hv, Dv] in q's dtype, final_state
    fp32 [B, Hv, Dk, Dv], a new tensor). ``block_v``: state columns per program of the sequential
    pass (None: chosen)."""
    what = "chunk_gated_delta_rule"
    group = _check(q, k, v, g, beta, what)
    check_power_of_two(chunk_size, "chunk_size", what)
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: cu_seqlens must be int32 or int64 [B+1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    batch = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        check_state(initial_state, batch, k, v, "initial_state", what)
    q, k, v, g, beta = _rows(q, k, v, g, beta)
    head_k, head_v = k.shape[2], v.shape[2]
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    final = torch.empty(batch, v.shape[1], head_k, head_v, dtype=torch.float32, device=q.device)
    if batch <= 0:
        return out, final
    bv = _block_v(head_v, block_v, what)
    h0 = final if initial_state is None else _rows(initial_state)[0]
    precision = dot_precision(q.dtype)
    heads = v.shape[1]
    cu = cu_seqlens.to(q.device)
    bos, eos, first_chunk = _chunk_bounds(cu, chunk_size, q.shape[0])
    w = torch.empty(k.shape[0], heads, head_k, dtype=torch.float32, device=q.device)
    u = torch.empty(v.shape, dtype=torch.float32, device=q.device)  # U, then V'
    f = torch.empty(g.shape, dtype=torch.float32, device=q.device)
    states = torch.empty(bos.shape[0], heads, head_k, head_v, dtype=torch.float32, device=q.device)
    tile_k = min(LANE_TILE, head_dim_pad(head_k))
    wy_kernel[(bos.shape[0], heads)](
        k, v, g, beta, bos, eos, w, u, f, group, head_k, head_v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), w.stride(0), w.stride(1),
        u.stride(0), u.stride(1),
        CHUNK=chunk_size, TILE_K=tile_k, TILE_V=min(LANE_TILE, head_dim_pad(head_v)),
        L2NORM=use_qk_l2norm, PRECISION=precision, num_warps=WY_WARPS, num_stages=1,
    )
    state_kernel[(triton.cdiv(head_v, bv), heads, batch)](
        # h0, final and states are row-major with [Dk, Dv] last: one key-row stride serves all three
        k, g, w, u, f, cu, first_chunk, h0, final, states, group, head_k, head_v,
        k.stride(0), k.stride(1), g.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        final.stride(0), final.stride(1), states.stride(0), states.stride(1), final.stride(2),
        CHUNK=chunk_size, TILE_K=min(STATE_TILE, head_dim_pad(head_k)), BLOCK_V=bv,
        HAS_INITIAL=initial_state is not None, PRECISION=precision, num_warps=STATE_WARPS, num_stages=1,
    )
    output_kernel[(bos.shape[0], heads, triton.cdiv(head_v, OUT_BLOCK_V))](
        q, k, g, u, states, bos, eos, out, head_k ** -0.5 if scale is None else scale, group, head_k, head_v,
        q.stride(0), q.stride(1), g.stride(0), u.stride(0), u.stride(1), states.stride(0), states.stride(1),
        states.stride(2), out.stride(0), out.stride(1),
        CHUNK=chunk_size, TILE_K=tile_k, BLOCK_V=min(OUT_BLOCK_V, head_dim_pad(head_v)),
        L2NORM=use_qk_l2norm, PRECISION=precision, num_warps=OUT_WARPS, num_stages=1,
    )
    return out, final


def fused_recurrent_gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                            g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                            use_qk_l2norm: bool = True, scale: float | None = None, *,
                                            block_v: int | None = None) -> torch.Tensor:
    """Decode: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; ``state`` (fp32 [B, Hv, Dk, Dv],
    row-major) is updated IN PLACE; returns o [B, Hv, Dv] in q's dtype."""
    what = "fused_recurrent_gated_delta_rule_update"
    group = _check(q, k, v, g, beta, what)
    check_state(state, q.shape[0], k, v, "state", what)
    if not state.is_contiguous():
        raise ValueError(f"{what}: state must be contiguous (it is updated in place)")
    q, k, v, g, beta = _rows(q, k, v, g, beta)
    head_k, head_v = k.shape[2], v.shape[2]
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    bv = _block_v(head_v, block_v, what, STEP_BLOCK_V)
    grid = (triton.cdiv(head_v, bv), v.shape[1], q.shape[0])
    step_kernel[grid](
        q, k, v, g, beta, state, out,
        head_k ** -0.5 if scale is None else scale, group, head_k, head_v,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        BLOCK_K=head_dim_pad(head_k), BLOCK_V=bv, L2NORM=use_qk_l2norm, num_warps=4,
    )
    return out
