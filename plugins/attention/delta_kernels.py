"""The gated delta rule (Qwen3-Next's linear attention) in Triton: chunked prefill and fused decode.

Same arguments, results and math as ``delta_ref`` (read its docstring for the recurrence and the
chunked WY / UT-transform form); everything past the loads is fp32, whatever the input dtype.

Columns of the state are independent: every value column of ``S [Dk, Dv]`` is read and written by
the same keys, so a program owns one ``BLOCK_V`` slice of one head's state of one sequence
(grid ``(Dv / BLOCK_V, Hv, B)``), which keeps the slice in registers (Dk = 128 x 32 floats).

- ``_chunk_kernel`` (prefill): one program walks its sequence a chunk of ``CHUNK`` tokens at a time,
  carrying its state slice from chunk to chunk; inside a chunk all tokens are handled at once by
  matmuls (the WY form). ``(I + A)^-1`` of the strictly lower ``A`` is built by forward substitution
  (``_unit_lower_inverse``, a row per step on a ``[CHUNK, CHUNK]`` tile), which keeps the stability
  of a triangular solve. Programs of one sequence's other value slices recompute the same ``W``
  (it depends on the keys only): cheap next to the ``CHUNK`` substitution steps, and no second
  launch or scratch buffer.
- ``_step_kernel`` (decode): one token, decay / delta-rule write / read fused over the state slice,
  written back in place.

Precision: fp32 inputs take exact fp32 dot products (``input_precision="ieee"``); 16-bit inputs
TF32 (``attn_ops.dot_precision``), as the attention kernels do. ``tl.dot`` needs every dimension
>= 16: ``CHUNK`` (``chunk_size``) is a power of two >= 16 and head dims are padded to one
(``attn_ops.head_dim_pad``), surplus lanes masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.attn_ops import DTYPES, check_power_of_two, dot_precision, head_dim_pad
from lmplug_attention.delta_ref import L2NORM_EPS, check_gated_delta, check_state

MAX_HEAD_DIM = 256  # a head's keys are one tile of head_dim_pad lanes
BLOCK_V = 32  # state columns per program: a Dk = 128 slice is 4096 floats, 32 per thread at 4 warps
_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def _normalized(x, L2NORM: tl.constexpr):
    """Rows of x [N, D] (fp32) scaled to unit length (eps inside the rsqrt) when L2NORM."""
    if L2NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, axis=1) + _EPS)[:, None]
    return x


@triton.jit
def _unit_lower_inverse(a, CHUNK: tl.constexpr):
    """(I + a)^-1 for a strictly lower [CHUNK, CHUNK] a: row i = e_i - sum_{j<i} a_ij row j."""
    offs = tl.arange(0, CHUNK)
    inv = tl.zeros([CHUNK, CHUNK], tl.float32)
    for i in range(CHUNK):
        row = offs[:, None] == i
        a_i = tl.sum(tl.where(row, a, 0.0), axis=0)  # a[i, :]; zero at j >= i
        inv_i = tl.where(offs == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(row, inv_i[None, :], inv)
    return inv


@triton.jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_seqlens_ptr, h0_ptr, ht_ptr, o_ptr,
    scale, group, head_k, head_v,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh,
    stride_sb, stride_sh, stride_sk,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_INITIAL: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr,
):
    tl.static_assert(CHUNK >= 16)
    i_v = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # token x stride passes 2^31 in long prompts
    eos = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    head_qk = head // group
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < head_k
    mask_v = offs_v < head_v
    lower = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]

    state_at = seq * stride_sb + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    if HAS_INITIAL:
        state = tl.load(h0_ptr + state_at, mask=state_mask, other=0.0)  # [BLOCK_K, BLOCK_V]
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)

    for start in range(bos, eos, CHUNK):
        pos = start + offs_c
        mask_c = pos < eos
        qk_at = pos[:, None] * stride_qt + head_qk * stride_qh + offs_k[None, :]
        qk_mask = mask_c[:, None] & mask_k[None, :]
        # past the end: k = v = beta = g = 0, tokens that neither decay nor write
        k = _normalized(tl.load(k_ptr + qk_at, mask=qk_mask, other=0.0).to(tl.float32), L2NORM)
        q = _normalized(tl.load(q_ptr + qk_at, mask=qk_mask, other=0.0).to(tl.float32), L2NORM) * scale
        v = tl.load(v_ptr + pos[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
                    mask=mask_c[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + pos * stride_gt + head, mask=mask_c, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + pos * stride_gt + head, mask=mask_c, other=0.0).to(tl.float32)

        cum = tl.cumsum(g, axis=0)  # G, inclusive
        g_last = tl.sum(g, axis=0)
        # D_ij = exp(G_i - G_j) on and below the diagonal; masked before exp (no overflow above it)
        decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))
        a = tl.where(strict, beta[:, None] * tl.dot(k, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        inv = _unit_lower_inverse(a, CHUNK)
        u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)  # [CHUNK, BLOCK_V]
        w = tl.dot(inv, k * (beta * tl.exp(cum))[:, None], input_precision=PRECISION)  # [CHUNK, BLOCK_K]
        v_new = u - tl.dot(w, state, input_precision=PRECISION)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay  # zero above the diagonal
        out = (tl.dot(q * tl.exp(cum)[:, None], state, input_precision=PRECISION)
               + tl.dot(scores, v_new, input_precision=PRECISION))
        tl.store(o_ptr + pos[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_c[:, None] & mask_v[None, :])

        k_write = k * tl.exp(g_last - cum)[:, None]
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k_write), v_new, input_precision=PRECISION)

    tl.store(ht_ptr + state_at, state, mask=state_mask)


@triton.jit
def _step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr,
    scale, group, head_k, head_v,
    stride_qb, stride_qh, stride_vb, stride_vh, stride_gb, stride_ob, stride_oh,
    stride_sb, stride_sh, stride_sk,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
):
    i_v = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < head_k
    mask_v = offs_v < head_v

    qk_at = seq * stride_qb + (head // group) * stride_qh + offs_k
    k = _normalized(tl.load(k_ptr + qk_at, mask=mask_k, other=0.0).to(tl.float32)[None, :], L2NORM)
    q = _normalized(tl.load(q_ptr + qk_at, mask=mask_k, other=0.0).to(tl.float32)[None, :], L2NORM)
    k = tl.reshape(k, [BLOCK_K])
    q = tl.reshape(q, [BLOCK_K]) * scale
    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + seq * stride_gb + head).to(tl.float32)
    beta = tl.load(beta_ptr + seq * stride_gb + head).to(tl.float32)

    state_at = state_ptr + seq * stride_sb + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_at, mask=state_mask, other=0.0) * tl.exp(g)  # [BLOCK_K, BLOCK_V]
    predicted = tl.sum(state * k[:, None], axis=0)
    state += k[:, None] * ((v - predicted) * beta)[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_v, out.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_at, state, mask=state_mask)


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


def _block_v(head_v: int, block_v: int | None, what: str) -> int:
    block = block_v or min(BLOCK_V, head_dim_pad(head_v))
    check_power_of_two(block, "block_v", what)
    return block


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor,
                           initial_state: torch.Tensor | None = None, chunk_size: int = 64,
                           use_qk_l2norm: bool = True, scale: float | None = None, *,
                           block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g (log-decay), beta [T, Hv], cu_seqlens [B+1] (int32/int64),
    initial_state (fp32 [B, Hv, Dk, Dv], None: zeros) -> (o [T, Hv, Dv] in q's dtype, final_state
    fp32 [B, Hv, Dk, Dv], a new tensor). ``block_v``: state columns per program (None: chosen)."""
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
    grid = (triton.cdiv(head_v, bv), v.shape[1], batch)
    # 8 warps: compiled for sm_90 at Dk = Dv = 128, chunk 64 (Triton 3.7), 4 warps spilled 884 B (bf16)
    # and 74 KB (fp32), 8 warps 940 B and 30 KB; untuned beyond that (no GPU run yet)
    _chunk_kernel[grid](
        q, k, v, g, beta, cu_seqlens.to(q.device), h0, final, out,
        head_k ** -0.5 if scale is None else scale, group, head_k, head_v,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
        final.stride(0), final.stride(1), final.stride(2),
        CHUNK=chunk_size, BLOCK_K=head_dim_pad(head_k), BLOCK_V=bv, HAS_INITIAL=initial_state is not None,
        L2NORM=use_qk_l2norm, PRECISION=dot_precision(q.dtype), num_warps=8, num_stages=1,
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
    bv = _block_v(head_v, block_v, what)
    grid = (triton.cdiv(head_v, bv), v.shape[1], q.shape[0])
    _step_kernel[grid](
        q, k, v, g, beta, state, out,
        head_k ** -0.5 if scale is None else scale, group, head_k, head_v,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        BLOCK_K=head_dim_pad(head_k), BLOCK_V=bv, L2NORM=use_qk_l2norm, num_warps=4,
    )
    return out
