"""The gated delta rule's Triton kernels (Qwen3-Next's linear attention): chunked prefill, fused decode.

Same arguments, results and math as ``delta_ref`` (read its docstring for the recurrence and the
chunked WY / UT-transform form); everything past the loads is fp32, whatever the input dtype.

Prefill, in three launches (the split of flash-linear-attention's ``chunk_gated_delta_rule``), over
fp32 scratch buffers; a chunk never crosses a sequence start, and its rows past the sequence end are
masked (``k = v = beta = g = 0``: tokens that neither decay nor write):

1. ``wy_kernel``, one program per (chunk, value head), all chunks in parallel: ``A`` (strictly
   lower ``diag(beta) K K^T * D``), ``(I + A)^-1`` by forward substitution (``_unit_lower_inverse``,
   a row per step on a ``[CHUNK, CHUNK]`` tile: the stability of a triangular solve), then
   ``W = (I + A)^-1 diag(beta exp(G)) K`` and ``U = (I + A)^-1 diag(beta) V`` to buffers, and the
   per-token factor ``F = exp(G_C - G) / |k|`` with which a key enters the chunk's end state.
2. ``state_kernel``, one program per (``BLOCK_V`` state columns, value head, sequence): the only
   sequential pass. Chunk by chunk, ``V' = U - W S`` (over ``U`` in place) and
   ``S <- exp(G_C) S + (diag(F) K)^T V'``. Columns of ``S`` are independent (each is read and
   written by the same keys), so value slices split exactly. The state entering every chunk goes
   to a buffer ``h [chunks, Hv, Dk, Dv]``, which is also where the pass reads it back from: every
   product takes ``STATE_TILE`` key rows of it at a time, so no ``[Dk, BLOCK_V]`` tile is held in
   registers (a barrier orders a chunk's writes before the next chunk's reads).
3. ``output_kernel``, one program per (chunk, value head, ``OUT_BLOCK_V`` columns), in parallel:
   ``O = diag(exp(G)) Q S + lower(Q K^T * D) V'``.

Why split: one program doing all of it (the state in registers) spilled on sm_80 / sm_90 at
Dk = Dv = 128 (940 B bf16, 30 KB fp32, chunk 64). Here every product accumulates over ``LANE_TILE``
/ ``STATE_TILE`` key lanes read from memory (fp32's CUDA-core ``ieee`` products spill first with a
long K), and q, k enter the products raw, their l2norm applied as a row / column scale of the
product: no spills for fp16 / bf16 / fp32 at chunks 16 / 32 / 64 on sm_80 and sm_90 (Triton 3.7.1,
compiled offline; head sizes are runtime ints, so all compile to the same code). Launch sizes
are chosen to fit, not yet timed on a GPU. Scratch, fp32: ``W``, ``U``, ``F`` and ``h``, the
latter ``T // CHUNK + B`` states (a bound on the chunk count that needs no read-back of
``cu_seqlens``) of ``Hv * Dk * Dv * 4`` bytes.

Decode, ``step_kernel``: one token, decay / delta-rule write / read fused over a ``[Dk, BLOCK_V]``
state slice in registers, written back in place.

Precision: fp32 inputs take exact fp32 dot products (``input_precision="ieee"``); 16-bit inputs
TF32 (``attn_ops.dot_precision``) on their fp32-widened values, as the attention kernels do.
``tl.dot`` needs every dimension >= 16: ``CHUNK`` (``chunk_size``) is a power of two >= 16 and
head dims are covered by tiles of 16 or more lanes, surplus lanes masked.

Only the ``@triton.jit`` functions live here; ``delta_kernels.py`` checks the arguments, sizes
the scratch buffers and launches them (``tools/gpu_compile.py`` reaches them through it).
"""

from __future__ import annotations

import triton
import triton.language as tl
from lmplug_mixer.delta_ref import L2NORM_EPS

_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def _normalized(x, L2NORM: tl.constexpr):
    """Rows of x [N, D] (fp32) scaled to unit length (eps inside the rsqrt) when L2NORM."""
    if L2NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, axis=1) + _EPS)[:, None]
    return x


@triton.jit
def _inverse_norm(norm2, L2NORM: tl.constexpr):
    """1 / sqrt(norm2 + eps) (the l2norm's row factor) of squared norms [N] when L2NORM, else ones."""
    if L2NORM:
        factor = tl.math.rsqrt(norm2 + _EPS)
    else:
        factor = tl.full(norm2.shape, 1.0, tl.float32)
    return factor


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
def wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, chunk_bos_ptr, chunk_eos_ptr, w_ptr, u_ptr, f_ptr,
    group, head_k, head_v,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_wt, stride_wh, stride_ut, stride_uh,
    CHUNK: tl.constexpr, TILE_K: tl.constexpr, TILE_V: tl.constexpr,
    L2NORM: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk of one value head: W = (I + A)^-1 diag(beta exp(G)) K, U = (I + A)^-1 diag(beta) V
    and F = exp(G_C - G) / |k| (k's normalization as row factors: K here is the raw keys)."""
    tl.static_assert(CHUNK >= 16)
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    bos = tl.load(chunk_bos_ptr + chunk)  # int64: token x stride passes 2^31 in long prompts
    eos = tl.load(chunk_eos_ptr + chunk)
    offs_c = tl.arange(0, CHUNK)
    offs_tk = tl.arange(0, TILE_K)
    offs_tv = tl.arange(0, TILE_V)
    pos = bos + offs_c
    mask_c = pos < eos
    k_rows = k_ptr + pos[:, None] * stride_kt + (head // group) * stride_kh
    # past the end: k = v = beta = g = 0, tokens that neither decay nor write
    g = tl.load(g_ptr + pos * stride_gt + head, mask=mask_c, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + pos * stride_gt + head, mask=mask_c, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)  # G, inclusive

    # K K^T and the squared row norms, TILE_K key lanes at a time
    gram = tl.zeros([CHUNK, CHUNK], tl.float32)
    norm2 = tl.zeros([CHUNK], tl.float32)
    for lo in range(0, head_k, TILE_K):
        lanes = lo + offs_tk
        k = tl.load(k_rows + lanes[None, :], mask=mask_c[:, None] & (lanes < head_k)[None, :],
                    other=0.0).to(tl.float32)
        gram += tl.dot(k, tl.trans(k), input_precision=PRECISION)
        norm2 += tl.sum(k * k, axis=1)
    rnorm = _inverse_norm(norm2, L2NORM)
    lower = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]
    # D_ij = exp(G_i - G_j) on and below the diagonal; masked before exp (no overflow above it)
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))
    a = tl.where(strict, (beta * rnorm)[:, None] * gram * rnorm[None, :] * decay, 0.0)
    inv = _unit_lower_inverse(a, CHUNK)
    # F: how much of each key the chunk's end state keeps (g sums to G_C: zero past the end)
    tl.store(f_ptr + pos * stride_gt + head, rnorm * tl.exp(tl.sum(g, axis=0) - cum), mask=mask_c)

    key_scale = (beta * rnorm * tl.exp(cum))[:, None]
    for lo in range(0, head_k, TILE_K):
        lanes = lo + offs_tk
        mask = mask_c[:, None] & (lanes < head_k)[None, :]
        k = tl.load(k_rows + lanes[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.dot(inv, k * key_scale, input_precision=PRECISION)
        tl.store(w_ptr + pos[:, None] * stride_wt + head * stride_wh + lanes[None, :], w, mask=mask)
    for lo in range(0, head_v, TILE_V):
        lanes = lo + offs_tv
        mask = mask_c[:, None] & (lanes < head_v)[None, :]
        v = tl.load(v_ptr + pos[:, None] * stride_vt + head * stride_vh + lanes[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + pos[:, None] * stride_ut + head * stride_uh + lanes[None, :], u, mask=mask)


@triton.jit
def state_kernel(
    k_ptr, g_ptr, w_ptr, u_ptr, f_ptr, cu_seqlens_ptr, first_chunk_ptr, h0_ptr, ht_ptr, h_ptr,
    group, head_k, head_v,
    stride_kt, stride_kh, stride_gt, stride_wt, stride_wh, stride_ut, stride_uh,
    stride_sb, stride_sh, stride_hn, stride_hh, stride_dk,
    CHUNK: tl.constexpr, TILE_K: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_INITIAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """One BLOCK_V slice of one head's state along one sequence, chunk by chunk: V' = U - W S over U
    in place, S = exp(G_C) S + (F K)^T V' (F = diag(1/|k| exp(G_C - G)), ``wy_kernel``'s factors).

    The state lives in ``h`` (the state entering each chunk, which the output kernel reads), not in
    registers: each product takes TILE_K rows of it from memory, which bounds the registers of the
    fp32 products (CUDA-core FMA, no tensor cores) whatever the head size."""
    i_v = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    chunk = tl.load(first_chunk_ptr + seq)
    offs_c = tl.arange(0, CHUNK)
    offs_tk = tl.arange(0, TILE_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < head_v
    tile_at = offs_tk[:, None] * stride_dk + offs_v[None, :]  # one TILE_K x BLOCK_V tile of a state
    h_head = h_ptr + head * stride_hh + tile_at
    final = ht_ptr + seq * stride_sb + head * stride_sh + tile_at

    # the starting state: to the first chunk's slot (if any) and to the final state (an empty
    # sequence keeps it)
    for lo in range(0, head_k, TILE_K):
        mask = ((lo + offs_tk) < head_k)[:, None] & mask_v[None, :]
        if HAS_INITIAL:
            state = tl.load(h0_ptr + seq * stride_sb + head * stride_sh + lo * stride_dk + tile_at, mask=mask)
        else:
            state = tl.zeros([TILE_K, BLOCK_V], tl.float32)
        tl.store(final + lo * stride_dk, state, mask=mask)
        tl.store(h_head + chunk * stride_hn + lo * stride_dk, state, mask=mask & (bos < eos))

    for start in range(bos, eos, CHUNK):
        tl.debug_barrier()  # the state slot written by every thread of the program
        source = h_head + chunk * stride_hn
        if start + CHUNK >= eos:
            target = final
        else:
            target = source + stride_hn
        pos = start + offs_c
        mask_c = pos < eos
        rows_v = mask_c[:, None] & mask_v[None, :]
        u_at = u_ptr + pos[:, None] * stride_ut + head * stride_uh + offs_v[None, :]
        v_new = tl.load(u_at, mask=rows_v, other=0.0)
        for lo in range(0, head_k, TILE_K):
            lanes = lo + offs_tk
            w = tl.load(w_ptr + pos[:, None] * stride_wt + head * stride_wh + lanes[None, :],
                        mask=mask_c[:, None] & (lanes < head_k)[None, :], other=0.0)
            state = tl.load(source + lo * stride_dk, mask=(lanes < head_k)[:, None] & mask_v[None, :], other=0.0)
            v_new -= tl.dot(w, state, input_precision=PRECISION)
        tl.store(u_at, v_new, mask=rows_v)

        g = tl.load(g_ptr + pos * stride_gt + head, mask=mask_c, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + pos * stride_gt + head, mask=mask_c, other=0.0)
        v_write = v_new * f[:, None]
        for lo in range(0, head_k, TILE_K):
            lanes = lo + offs_tk
            mask = (lanes < head_k)[:, None] & mask_v[None, :]
            k = tl.load(k_ptr + pos[:, None] * stride_kt + (head // group) * stride_kh + lanes[None, :],
                        mask=mask_c[:, None] & (lanes < head_k)[None, :], other=0.0).to(tl.float32)
            state = tl.load(source + lo * stride_dk, mask=mask, other=0.0) * tl.exp(tl.sum(g, axis=0))
            state += tl.dot(tl.trans(k), v_write, input_precision=PRECISION)
            tl.store(target + lo * stride_dk, state, mask=mask)
        chunk += 1


@triton.jit
def output_kernel(
    q_ptr, k_ptr, g_ptr, v_ptr, h_ptr, chunk_bos_ptr, chunk_eos_ptr, o_ptr,
    scale, group, head_k, head_v,
    stride_qt, stride_qh, stride_gt, stride_vt, stride_vh, stride_hn, stride_hh, stride_hk,
    stride_ot, stride_oh,
    CHUNK: tl.constexpr, TILE_K: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk, one head, BLOCK_V output columns: O = diag(exp(G)) Q S + lower(Q K^T * D) V'."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    i_v = tl.program_id(2)
    bos = tl.load(chunk_bos_ptr + chunk)
    eos = tl.load(chunk_eos_ptr + chunk)
    offs_c = tl.arange(0, CHUNK)
    offs_tk = tl.arange(0, TILE_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < head_v
    pos = bos + offs_c
    mask_c = pos < eos
    qk_rows = pos[:, None] * stride_qt + (head // group) * stride_qh
    h_at = h_ptr + chunk * stride_hn + head * stride_hh + offs_v[None, :]

    # Q S and Q K^T with the raw q, k, TILE_K key lanes at a time; the normalizations are row
    # (q) and column (k) scales of the products
    q_state = tl.zeros([CHUNK, BLOCK_V], tl.float32)
    scores = tl.zeros([CHUNK, CHUNK], tl.float32)
    q_norm2 = tl.zeros([CHUNK], tl.float32)
    k_norm2 = tl.zeros([CHUNK], tl.float32)
    for lo in range(0, head_k, TILE_K):
        lanes = lo + offs_tk
        mask = mask_c[:, None] & (lanes < head_k)[None, :]
        q = tl.load(q_ptr + qk_rows + lanes[None, :], mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_rows + lanes[None, :], mask=mask, other=0.0).to(tl.float32)
        state = tl.load(h_at + lanes[:, None] * stride_hk, mask=(lanes < head_k)[:, None] & mask_v[None, :],
                        other=0.0)
        q_state += tl.dot(q, state, input_precision=PRECISION)
        scores += tl.dot(q, tl.trans(k), input_precision=PRECISION)
        q_norm2 += tl.sum(q * q, axis=1)
        k_norm2 += tl.sum(k * k, axis=1)
    q_scale = _inverse_norm(q_norm2, L2NORM) * scale
    k_scale = _inverse_norm(k_norm2, L2NORM)
    g = tl.load(g_ptr + pos * stride_gt + head, mask=mask_c, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)
    lower = offs_c[:, None] >= offs_c[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))  # zero above the diagonal
    scores = scores * (q_scale[:, None] * k_scale[None, :] * decay)
    rows_v = mask_c[:, None] & mask_v[None, :]
    v_new = tl.load(v_ptr + pos[:, None] * stride_vt + head * stride_vh + offs_v[None, :], mask=rows_v, other=0.0)
    out = q_state * (q_scale * tl.exp(cum))[:, None] + tl.dot(scores, v_new, input_precision=PRECISION)
    tl.store(o_ptr + pos[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rows_v)


@triton.jit
def step_kernel(
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
