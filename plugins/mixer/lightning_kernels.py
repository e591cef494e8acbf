"""Lightning attention (MiniMax) in Triton: the chunked prefill over flattened sequences and the fused decode step.

The math and the block decomposition are ``lightning_ref``'s: with ``lambda = exp(-slope)`` per head,
``S_t = lambda S_{t-1} + k_t^T v_t`` and ``o_t = q_t S_t``; a block of ``c`` tokens (local positions
``i = 1..c``) adds ``((Q K^T) * lambda^(i-j) [j <= i]) V`` inside the block and ``(Q * lambda^i) S`` from
the blocks before, then carries ``S <- lambda^c S + (K * lambda^(c-i))^T V``.

Prefill: one program per (sequence, head, tile of ``BLOCK_V`` value columns) walks its sequence
``BLOCK_T`` tokens at a time. Its slice of the state, ``[Dk, BLOCK_V]`` fp32, lives in its own rows
of the final state (the initial state copied there first, or already there with a pool): per block,
a loop over the key lanes ``BLOCK_K`` at a time loads ``BLOCK_K`` rows of it, accumulates ``Q K^T``
and ``Q S`` over them, moves those rows to the block's end and stores them back, then the block's
output is ``(Q K^T * decay) V + lambda^i (Q S)``. Barriers order every thread's read of a row
before its overwrite, and a block's writes before the next block's reads; the slice is the
program's alone, so the round trips stay in L1/L2. Why not the whole slice in registers (the
first version): at ``Dk`` 64-128 it spilled on sm_80 and sm_90 (Triton 3.7.1, ``make
gpu-compile``): 76-520 B in fp16/bf16, 0.6-41 KB in fp32, whose exact (``ieee``) products run on
the CUDA cores and hold a whole ``Dk`` of operands per thread. Splitting the value columns is exact
(each column of ``S`` evolves on its own) and gives more programs to small batches. The decay terms
are computed in-kernel from the slope, in fp32. q/k/v may be strided views (the split of one qkv
projection): only the last dimension must be contiguous.

Decode: one program per (sequence, head, value tile) updates its state tile in place,
``S <- lambda S + k^T v``, and reduces ``o = q S`` over Dk: elementwise work on a memory-bound
state, no ``tl.dot``.

State slots (``state_indices``, semantics in ``lightning_ref``): the kernels offset the pool by
``slot * stride`` where they would offset a per-batch state by ``sequence * stride``; nothing is
gathered or copied. The prefill then walks its state in the slot itself.

Precision: the state and every accumulation are fp32. fp32 inputs take exact fp32 dot products
(``input_precision="ieee"``). fp16/bf16 inputs feed the tensor cores in their own dtype where the
operands are bounded by the inputs (the decayed scores and keys are rounded to it, as in FLA's
linear-attention kernels; fp16 scores beyond 65504 would overflow), and in TF32 for the product with
the state, which stays fp32 (it grows with the context); every product accumulates in fp32.

Launch configuration per architecture and input width: ``LIGHTNING_TABLE``, chosen so that every
configuration ``make gpu-compile`` builds (head dims 64 / 96 / 128, block sizes 16 / 32 / 64)
compiles without spills on sm_80 and sm_90; not yet timed on a GPU (nor whether software
pipelining, ``num_stages`` > 1, would pay: the loads sit between barriers and stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_mixer.lightning_ref import check_decode, check_prefill

from lmplug.kit.devices import capability
from lmplug.kit.triton_launch import arch_entry, dot_precision, head_dim_pad

# (BLOCK_T, BLOCK_K, BLOCK_V, num_warps, num_stages) per architecture (``attn_ops.arch_entry``) and
# input width (16-bit / fp32); None: the interpreter, whose BLOCK_K of 16 walks the key lanes in tiles
LIGHTNING_TABLE: dict[tuple[int, int] | None, dict[str, tuple[int, int, int, int, int]]] = {
    None: {"16-bit": (16, 16, 32, 4, 1), "fp32": (16, 16, 32, 4, 1)},
    (8, 0): {"16-bit": (64, 32, 64, 8, 1), "fp32": (32, 16, 32, 4, 1)},
    (9, 0): {"16-bit": (64, 32, 64, 8, 1), "fp32": (32, 16, 32, 4, 1)},
}
DECODE_BLOCK_V = 64  # value columns per decode program; the state tile is [Dk, DECODE_BLOCK_V]


@triton.jit
def _lightning_prefill_kernel(
    q_ptr, k_ptr, v_ptr, slope_ptr, cu_seqlens_ptr, idx_ptr, init_ptr, out_ptr, final_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ib, stride_ih, stride_ik, stride_iv,
    stride_fb, stride_fh, stride_fk, stride_fv,
    HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, HAS_INIT: tl.constexpr, HAS_INDICES: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)  # sequence x state stride can pass 2^31
    if HAS_INDICES:
        row = tl.load(idx_ptr + seq).to(tl.int64)  # the sequence's slot in the state pool
    else:
        row = seq
    head = tl.program_id(1).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < HEAD_V
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slope = tl.load(slope_ptr + head).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    # the program's state slice [HEAD_K, BLOCK_V] lives in its rows of the final state
    state_ptrs = final_ptr + row * stride_fb + head * stride_fh + offs_k[:, None] * stride_fk + offs_v[None, :] * stride_fv

    if not HAS_INDICES:  # with indices the initial state already is the final one (in place)
        for k0 in range(0, HEAD_K, BLOCK_K):
            mask_kv = (k0 + offs_k < HEAD_K)[:, None] & mask_v[None, :]
            if HAS_INIT:
                tile = tl.load(init_ptr + row * stride_ib + head * stride_ih + (k0 + offs_k)[:, None] * stride_ik
                               + offs_v[None, :] * stride_iv, mask=mask_kv, other=0.0)
            else:
                tile = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
            tl.store(state_ptrs + k0 * stride_fk, tile, mask=mask_kv)
    # block-invariant decays: lambda^i for the state seen at local position i (1-based), and the
    # causal mask lambda^(i-j), j <= i, inside a block
    q_decay = tl.exp(-slope * (offs_t + 1).to(tl.float32))
    diff = (offs_t[:, None] - offs_t[None, :]).to(tl.float32)
    intra_decay = tl.where(diff >= 0, tl.exp(-slope * tl.maximum(diff, 0.0)), 0.0)

    for start in range(bos, eos, BLOCK_T):
        tl.debug_barrier()  # the state tiles written before (other threads' stores) are visible
        rows = start + offs_t
        mask_t = rows < eos
        count = tl.minimum(eos - start, BLOCK_T).to(tl.float32)  # c, the tokens of this block
        # lambda^(c-i) for the key at local position i; padded rows get 0 (their exponent may overflow)
        k_decay = tl.where(mask_t, tl.exp(-slope * (count - 1.0 - offs_t.to(tl.float32))), 0.0)
        block_decay = tl.exp(-slope * count)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
                    mask=mask_t[:, None] & mask_v[None, :], other=0.0)
        scores = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        o_state = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        # over the key lanes BLOCK_K at a time: Q K^T, Q S with the state before this block, and
        # the state's rows moved to the block's end
        for k0 in range(0, HEAD_K, BLOCK_K):
            mask_k = k0 + offs_k < HEAD_K
            mask_tk = mask_t[:, None] & mask_k[None, :]
            q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + (k0 + offs_k)[None, :],
                        mask=mask_tk, other=0.0)
            k = tl.load(k_ptr + rows[:, None] * stride_kt + head * stride_kh + (k0 + offs_k)[None, :],
                        mask=mask_tk, other=0.0)
            mask_kv = mask_k[:, None] & mask_v[None, :]
            state = tl.load(state_ptrs + k0 * stride_fk, mask=mask_kv, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
            scores += tl.dot(q, tl.trans(k), input_precision=PRECISION)
            # the state stays fp32 in the product: over a long context of a slow-decaying head its
            # entries can pass fp16's range
            o_state += tl.dot(q.to(tl.float32), state, input_precision=PRECISION)
            k_new = (k.to(tl.float32) * k_decay[:, None]).to(dtype)
            state = state * block_decay + tl.dot(tl.trans(k_new), v, input_precision=PRECISION)
            tl.debug_barrier()  # every thread's read of these rows is done before they are overwritten
            tl.store(state_ptrs + k0 * stride_fk, state, mask=mask_kv)
        o = tl.dot((scores * intra_decay).to(dtype), v, input_precision=PRECISION) + o_state * q_decay[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :])


@triton.jit
def _lightning_decode_kernel(
    q_ptr, k_ptr, v_ptr, slope_ptr, state_ptr, idx_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ob, stride_oh,
    stride_sb, stride_sh, stride_sk, stride_sv,
    HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_INDICES: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= HEAD_K)
    seq = tl.program_id(0).to(tl.int64)
    if HAS_INDICES:
        row = tl.load(idx_ptr + seq).to(tl.int64)  # the sequence's slot in the state pool
    else:
        row = seq
    head = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < HEAD_K
    mask_v = offs_v < HEAD_V
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_kb + head * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    decay = tl.exp(-tl.load(slope_ptr + head).to(tl.float32))
    tile = (state_ptr + row * stride_sb + head * stride_sh
            + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv)
    mask_kv = mask_k[:, None] & mask_v[None, :]
    state = tl.load(tile, mask=mask_kv, other=0.0) * decay + k[:, None] * v[None, :]
    tl.store(tile, state, mask=mask_kv)
    o = tl.sum(q[:, None] * state, axis=0)  # [BLOCK_V]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_v, o.to(out_ptr.dtype.element_ty), mask=mask_v)


def _rows_contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels take strides for the token and head dims; the feature dim must be dense."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"lightning {what}: q, k, v must share one of fp32/fp16/bf16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")


def lightning_attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                                cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None,
                                block_size: int | None = None, *, state_indices: torch.Tensor | None = None,
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flattened sequences: q, k [T, H, Dk], v [T, H, Dv] -> (o [T, H, Dv] in q's dtype, final_state
    [B, H, Dk, Dv] fp32), as ``lightning_ref.lightning_attention_prefill``. ``initial_state`` (None: zeros)
    is read, not modified. ``block_size`` (a power of two >= 16; None: the architecture's) is the
    tokens per step of the walk; it changes only the rounding. With ``state_indices`` [B]: initial_state
    is the fp32 pool [num_slots, H, Dk, Dv], its rows state_indices overwritten in place by the final
    states, and None returned for them."""
    entry = arch_entry(LIGHTNING_TABLE, capability(q.device))["fp32" if q.dtype == torch.float32 else "16-bit"]
    block_t, block_k, block_v, num_warps, num_stages = entry
    block_t = block_size or block_t
    check_prefill(q, k, v, slope, cu_seqlens, initial_state, block_t, state_indices)
    _check_dtypes(q, k, v, "prefill")
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"lightning prefill: the Triton block_size must be a power of two >= 16, got {block_t}")
    q, k, v = _rows_contiguous(q, k, v)
    num_seqs, num_heads, head_k, head_v = cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2], v.shape[2]
    out = torch.empty(q.shape[0], num_heads, head_v, dtype=q.dtype, device=q.device)
    if state_indices is not None:
        final_state = initial_state  # rows state_indices written in place
    else:
        final_state = torch.empty(num_seqs, num_heads, head_k, head_v, dtype=torch.float32, device=q.device)
    result = None if state_indices is not None else final_state
    if num_seqs == 0:
        return out, result
    init = final_state if initial_state is None else initial_state.float()
    block_v = min(block_v, max(16, triton.next_power_of_2(head_v)))
    grid = (num_seqs, num_heads, triton.cdiv(head_v, block_v))
    _lightning_prefill_kernel[grid](
        q, k, v, slope.float().contiguous(), cu_seqlens.contiguous(),
        state_indices if state_indices is not None else cu_seqlens, init, out, final_state,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        *init.stride(), *final_state.stride(),
        HEAD_K=head_k, HEAD_V=head_v, BLOCK_T=block_t, BLOCK_K=min(block_k, head_dim_pad(head_k)),
        BLOCK_V=block_v, HAS_INIT=initial_state is not None, HAS_INDICES=state_indices is not None,
        PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return out, result


def lightning_attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                               state: torch.Tensor, *, state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence: q, k [B, H, Dk], v [B, H, Dv] -> o [B, H, Dv] in q's dtype; ``state``
    [B, H, Dk, Dv] fp32 (any strides) is updated in place, as ``lightning_ref.lightning_attention_decode``.
    With ``state_indices`` [B]: state is the pool [num_slots, H, Dk, Dv], rows state_indices updated in place."""
    check_decode(q, k, v, slope, state, state_indices)
    _check_dtypes(q, k, v, "decode")
    q, k, v = _rows_contiguous(q, k, v)
    batch, num_heads, head_k = q.shape
    head_v = v.shape[2]
    out = torch.empty(batch, num_heads, head_v, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_v = min(DECODE_BLOCK_V, triton.next_power_of_2(head_v))
    grid = (batch, num_heads, triton.cdiv(head_v, block_v))
    _lightning_decode_kernel[grid](
        q, k, v, slope.float().contiguous(), state, state_indices if state_indices is not None else out, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        *state.stride(),
        HEAD_K=head_k, HEAD_V=head_v, BLOCK_K=triton.next_power_of_2(head_k), BLOCK_V=block_v,
        HAS_INDICES=state_indices is not None,
    )
    return out
