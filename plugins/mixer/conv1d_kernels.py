"""Causal depthwise conv1d with a carried state in Triton: prefill over flattened sequences and the one-token update.

Same arguments and results as ``conv1d_ref.causal_conv1d`` /
``conv1d_ref.causal_conv1d_update`` (conventions there: ``conv_state
[B, C, K-1]``, the last K-1 inputs, oldest first).

Prefill: one program per tile of ``BLOCK_T`` flattened tokens and
``BLOCK_C`` channels. Each token knows its sequence (``seq_ids``, from
``cu_seqlens``) and so its position in it; tap k reads input position
``pos - (K-1) + k``: a row of x when >= 0, else a column of the sequence's
state. Tiles may straddle sequences, so varying lengths cost no padding and no
host-side maximum length. A second, small kernel writes each sequence's new
state (the last K-1 inputs of ``[state; sequence]``) into a new tensor, or,
with ``state_indices``, over the old one in the pool: it loads the whole
``[BLOCK_C, K-1]`` tile, waits at a barrier, then stores (a short sequence's new
state is its old one shifted, and threads of the program could otherwise read
columns another already overwrote).

Update: one program per (sequence, tile of channels) loads its window
``[state | x]`` as a ``[BLOCK_C, BLOCK_K]`` tile, takes the dot with the
filters, and writes the window shifted by one back into the state. Other
threads of the program may still be reading the columns being overwritten,
hence the barrier between the reads and the writes (programs own disjoint
channels, so no other program touches them).

State slots (``state_indices``, semantics in ``conv1d_ref``): the kernels
offset the pool by ``slot * stride`` where they would offset a per-batch state
by ``sequence * stride``; nothing is gathered or copied.

Sums in fp32; outputs in x's dtype, states in the state's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_mixer.conv1d_ref import check_activation, check_state_indices, sequence_positions

# tokens x channels per prefill program (BLOCK_C also per program of the state and update kernels).
# 16 x 64 spilled 32-108 B in fp16 on sm_80 / sm_90 (Triton 3.7.1) at 48-72 registers: ptxas's
# choice for 8 fp16 values a thread (32 x 64 at 8 warps does the same), not register pressure.
# 32 x 64 at 4 warps compiles without spills for every dtype and state layout of ``make
# gpu-compile`` under 3.7.1; under 3.6.0 too, but for fp32 with a carried state and a bias on sm_80 (64 B,
# inside the fp32 budget). It also halves the share of the K-1 rows a tile reads twice. Not yet
# timed on a GPU.
BLOCK_T, BLOCK_C = 32, 64


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, seq_ids_ptr, cu_ptr, idx_ptr, y_ptr,
    num_tokens, channels,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_sb, stride_sc, stride_sk, stride_yt,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INDICES: tl.constexpr, SILU: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # token x stride may pass 2^31
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < num_tokens
    mask_c = offs_c < channels
    seq = tl.load(seq_ids_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    pos = offs_t - tl.load(cu_ptr + seq, mask=mask_t, other=0)  # position in its sequence
    if HAS_INDICES:
        row = tl.load(idx_ptr + seq, mask=mask_t, other=0).to(tl.int64)  # its state's slot in the pool
    else:
        row = seq
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        j = pos - (K - 1) + k  # the input position this tap reads
        in_x = (j >= 0)[:, None]
        valid = mask_t[:, None] & mask_c[None, :]
        u = tl.load(x_ptr + (offs_t - (K - 1) + k)[:, None] * stride_xt + offs_c[None, :] * stride_xc,
                    mask=valid & in_x, other=0.0).to(tl.float32)
        if HAS_STATE:  # inputs before the sequence's first token come from its state
            u += tl.load(state_ptr + row[:, None] * stride_sb + offs_c[None, :] * stride_sc
                         + (K - 1 + j)[:, None] * stride_sk, mask=valid & ~in_x, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=mask_c, other=0.0).to(tl.float32)
        acc += u * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + offs_t[:, None] * stride_yt + offs_c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, cu_ptr, idx_ptr, new_ptr, channels,
    stride_xt, stride_xc, stride_sb, stride_sc, stride_sk, stride_nb, stride_nc, stride_nk,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, HAS_STATE: tl.constexpr,
    HAS_INDICES: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= K - 1)
    seq = tl.program_id(0).to(tl.int64)
    if HAS_INDICES:
        row = tl.load(idx_ptr + seq).to(tl.int64)
    else:
        row = seq
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c[:, None] < channels
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
    j = length - (K - 1) + offs_k  # input position of the new state's column k
    in_x = (j >= 0)[None, :]
    mask = mask_c & (offs_k < K - 1)[None, :]
    u = tl.load(x_ptr + (bos + j)[None, :] * stride_xt + offs_c[:, None] * stride_xc, mask=mask & in_x,
                other=0.0).to(new_ptr.dtype.element_ty)
    if HAS_STATE:
        old = tl.load(state_ptr + row * stride_sb + offs_c[:, None] * stride_sc + (K - 1 + j)[None, :] * stride_sk,
                      mask=mask & ~in_x, other=0.0)
        u = tl.where(in_x, u, old.to(new_ptr.dtype.element_ty))
    if HAS_INDICES:
        tl.debug_barrier()  # in place: every read of the old state is done before it is overwritten
    tl.store(new_ptr + row * stride_nb + offs_c[:, None] * stride_nc + offs_k[None, :] * stride_nk, u, mask=mask)


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, state_ptr, idx_ptr, w_ptr, bias_ptr, y_ptr, channels,
    stride_xb, stride_xc, stride_sb, stride_sc, stride_sk, stride_wc, stride_wk, stride_yb,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INDICES: tl.constexpr, SILU: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= K)
    seq = tl.program_id(0).to(tl.int64)
    if HAS_INDICES:
        row = tl.load(idx_ptr + seq).to(tl.int64)  # the sequence's slot in the state pool
    else:
        row = seq
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < channels
    in_state = mask_c[:, None] & (offs_k < K - 1)[None, :]
    state_ptrs = state_ptr + row * stride_sb + offs_c[:, None] * stride_sc
    # the window [state (K-1) | x], oldest first: [BLOCK_C, BLOCK_K]
    window = tl.load(state_ptrs + offs_k[None, :] * stride_sk, mask=in_state, other=0.0)
    x = tl.load(x_ptr + seq * stride_xb + offs_c * stride_xc, mask=mask_c, other=0.0)
    window = tl.where((offs_k == K - 1)[None, :], x[:, None].to(window.dtype), window)
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_k[None, :] * stride_wk,
                mask=mask_c[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(window.to(tl.float32) * w, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + seq * stride_yb + offs_c, acc.to(y_ptr.dtype.element_ty), mask=mask_c)
    tl.debug_barrier()  # every read of the state above is done before it is overwritten
    # column k of the new state is column k + 1 of the window
    tl.store(state_ptrs + (offs_k[None, :] - 1) * stride_sk, window,
             mask=mask_c[:, None] & (offs_k >= 1)[None, :] & (offs_k < K)[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, batch: int,
           state_indices: torch.Tensor | None, what: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"{what}: x must be [tokens, C] and weight [C, K] with K >= 2; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if state_indices is not None:
        check_state_indices(state_indices, conv_state, batch, what)
        rows, name = conv_state.shape[0], "the pool [num_slots, C, K-1]"
    else:
        rows, name = batch, "[B, C, K-1]"
    expected = (rows, x.shape[1], weight.shape[1] - 1)
    if conv_state is not None and tuple(conv_state.shape) != expected:
        raise ValueError(f"{what}: conv_state must be {name} = {list(expected)}; got {list(conv_state.shape)}")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cu_seqlens: torch.Tensor, conv_state: torch.Tensor | None = None,
                  activation: str | None = "silu", *, state_indices: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, C], weight [C, K], bias [C] or None, cu_seqlens [B+1], conv_state [B, C, K-1] (None:
    zeros, fresh sequences) -> (y [T, C] in x's dtype, new conv_state [B, C, K-1], a new tensor). With
    ``state_indices`` [B]: conv_state is the pool [num_slots, C, K-1], rows updated in place, None returned."""
    check_activation(activation, "causal_conv1d")
    batch = cu_seqlens.shape[0] - 1
    _check(x, weight, conv_state, batch, state_indices, "causal_conv1d")
    num_tokens, channels = x.shape
    width = weight.shape[1]
    y = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    has_state, has_indices = conv_state is not None, state_indices is not None
    if has_indices:
        new_state = conv_state  # written in place, rows state_indices
    else:
        new_state = torch.empty(batch, channels, width - 1, device=x.device,
                                dtype=conv_state.dtype if has_state else x.dtype)
    result = None if has_indices else new_state
    if batch == 0:
        return y, result
    state = conv_state if has_state else new_state  # not read without HAS_STATE
    indices = state_indices if has_indices else cu_seqlens  # not read without HAS_INDICES
    seq_ids, _ = sequence_positions(cu_seqlens, num_tokens)
    c_tiles = triton.cdiv(channels, BLOCK_C)
    if num_tokens:
        _causal_conv1d_kernel[(triton.cdiv(num_tokens, BLOCK_T), c_tiles)](
            x, weight, bias if bias is not None else weight, state, seq_ids, cu_seqlens, indices, y,
            num_tokens, channels, *x.stride(), *weight.stride(), *state.stride(), y.stride(0),
            K=width, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, HAS_BIAS=bias is not None,
            HAS_STATE=has_state, HAS_INDICES=has_indices, SILU=activation is not None,
        )
    _conv_state_kernel[(batch, c_tiles)](
        x, state, cu_seqlens, indices, new_state, channels, *x.stride(), *state.stride(), *new_state.stride(),
        K=width, BLOCK_C=BLOCK_C, BLOCK_K=triton.next_power_of_2(width), HAS_STATE=has_state,
        HAS_INDICES=has_indices,
    )
    return y, result


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, activation: str | None = "silu", *,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence: x [B, C], conv_state [B, C, K-1] (rolled in place) -> y [B, C]. With
    ``state_indices`` [B]: conv_state is the pool [num_slots, C, K-1], rows state_indices rolled in place."""
    check_activation(activation, "causal_conv1d_update")
    _check(x, weight, conv_state, x.shape[0], state_indices, "causal_conv1d_update")
    batch, channels = x.shape
    y = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    _causal_conv1d_update_kernel[(batch, triton.cdiv(channels, BLOCK_C))](
        x, conv_state, state_indices if state_indices is not None else y, weight,
        bias if bias is not None else weight, y, channels,
        *x.stride(), *conv_state.stride(), *weight.stride(), y.stride(0),
        K=weight.shape[1], BLOCK_C=BLOCK_C, BLOCK_K=triton.next_power_of_2(weight.shape[1]),
        HAS_BIAS=bias is not None, HAS_INDICES=state_indices is not None, SILU=activation is not None,
    )
    return y
