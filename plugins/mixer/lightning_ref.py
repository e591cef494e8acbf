"""Lightning attention (MiniMax-Text-01) in PyTorch: the CPU path and the reference for the Triton kernels.

Lightning attention is causal linear attention with a fixed exponential decay per head. With
``lambda_h = exp(-slope_h)`` each head keeps a state ``S`` of shape ``[Dk, Dv]``:

    S_t = lambda * S_{t-1} + k_t^T v_t          o_t = q_t S_t

(no softmax, no 1/sqrt(d) scale; q/k/v are the silu-activated projections). Unrolled,
``o_t = lambda^(t+1) q_t S_init + sum_{j<=t} lambda^(t-j) (q_t . k_j) v_j``.

The prefill computes this block by block (Qin et al. 2024, "Lightning Attention-2"), as
``transformers``' ``MiniMaxLightningAttention`` does. For a block of ``c`` tokens at local
positions ``i = 1..c`` and the state ``S`` carried in from the blocks before it:

- intra (inside the block): ``((Q K^T) * M) V`` with ``M[i, j] = lambda^(i-j)`` for ``j <= i``, else 0;
- inter (the blocks before): ``(Q * lambda^i) S``;
- carry: ``S <- lambda^c S + (K * lambda^(c-i))^T V``.

The split into blocks changes only the rounding, never the result, so ``block_size`` is free;
MiniMax's checkpoints use 256. States are fp32 whatever the input dtype.

Layout: sequences flattened along dim 0 (``q/k: [T, H, Dk]``, ``v: [T, H, Dv]``) with
``cu_seqlens [B + 1]``; states ``[B, H, Dk, Dv]`` fp32. ``lightning_slopes`` gives the per-head
slopes of one layer, as the model derives them from the layer index.

State slots: prefill and decode take an optional ``state_indices [B]`` (int32/int64); the state
argument is then a pool ``[num_slots, H, Dk, Dv]`` fp32 and sequence b reads and writes row
``state_indices[b]`` in place (the prefill returns None for the final states, which are in the
pool), as ``conv1d_ref`` describes.
"""

from __future__ import annotations

import torch
from lmplug_mixer.conv1d_ref import check_state_indices

DEFAULT_BLOCK_SIZE = 256  # MiniMax-Text-01's config.block_size


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """The decay rates ``slope [H]`` (fp32) of lightning layer ``layer_idx`` of ``num_layers``.

    ALiBi's geometric slopes ``(2^(-8/H))^(h+1)``, scaled down linearly with depth (the first layer
    decays fastest, the last one barely): ``* (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)``."""
    base = 2.0 ** (-8.0 / num_heads)
    exponent = torch.arange(1, num_heads + 1, dtype=torch.float64, device=device)
    factor = 1.0 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** exponent * factor).to(torch.float32)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, what: str) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"lightning {what}: q, k must be [N, H, Dk] and v [N, H, Dv] with the same N, H; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if slope.shape != (q.shape[1],):
        raise ValueError(f"lightning {what}: slope must be [H] = [{q.shape[1]}], got {tuple(slope.shape)}")


def check_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                  cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, block_size: int,
                  state_indices: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` unless the prefill's arguments fit together (shared with the kernel wrapper)."""
    _check(q, k, v, slope, "prefill")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"lightning prefill: cu_seqlens must be [B + 1], got {tuple(cu_seqlens.shape)}")
    state_shape = (cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2], v.shape[2])
    if state_indices is not None:
        check_state_indices(state_indices, initial_state, state_shape[0], "lightning prefill")
        pool_shape = (initial_state.shape[0], *state_shape[1:])
        if tuple(initial_state.shape) != pool_shape or initial_state.dtype != torch.float32:
            raise ValueError(f"lightning prefill: with state_indices, initial_state must be the fp32 pool "
                             f"[num_slots, H, Dk, Dv] = {list(pool_shape)}, got {initial_state.dtype} "
                             f"{tuple(initial_state.shape)}")
    elif initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"lightning prefill: initial_state must be [B, H, Dk, Dv] = {list(state_shape)}, "
                         f"got {tuple(initial_state.shape)}")
    if block_size < 1:
        raise ValueError(f"lightning prefill: block_size must be positive, got {block_size}")


def check_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                 state: torch.Tensor, state_indices: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` unless the decode step's arguments fit together (shared with the kernel wrapper)."""
    _check(q, k, v, slope, "decode")
    state_shape = (*q.shape, v.shape[2])
    if state_indices is not None:
        check_state_indices(state_indices, state, q.shape[0], "lightning decode")
        state_shape = (state.shape[0], *state_shape[1:])  # a pool: any number of slots
    if tuple(state.shape) != state_shape or state.dtype != torch.float32:
        raise ValueError(f"lightning decode: state must be fp32 [B, H, Dk, Dv] = {list(state_shape)}, got "
                         f"{state.dtype} {tuple(state.shape)}")


def _prefill_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                      state: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, fp32: q, k [H, L, Dk], v [H, L, Dv], state [H, Dk, Dv] -> (o [H, L, Dv], final state)."""
    rate = slope[:, None]  # [H, 1]
    pos = torch.arange(1, block_size + 1, device=q.device, dtype=torch.float32)
    q_decay = torch.exp(-rate * pos)  # [H, C]: lambda^i, the state's age at local position i
    k_decay = torch.exp(-rate * (block_size - pos))  # [H, C]: lambda^(C-i); a block of c takes the last c
    diff = pos[:, None] - pos[None, :]  # [C, C]: i - j
    mask = torch.exp(-rate[:, :, None] * diff.clamp(min=0)) * (diff >= 0)  # [H, C, C]: lambda^(i-j), causal
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[1], block_size):
        qb, kb, vb = (x[:, start:start + block_size] for x in (q, k, v))  # [H, c, D]
        c = qb.shape[1]
        intra = (qb @ kb.transpose(1, 2) * mask[:, :c, :c]) @ vb
        inter = (qb * q_decay[:, :c, None]) @ state
        out[:, start:start + c] = intra + inter
        state = state * torch.exp(-slope * c)[:, None, None] + (kb * k_decay[:, -c:, None]).transpose(1, 2) @ vb
    return out, state


def lightning_attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                                cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None,
                                block_size: int = DEFAULT_BLOCK_SIZE, *, state_indices: torch.Tensor | None = None,
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flattened sequences: q, k [T, H, Dk], v [T, H, Dv] -> (o [T, H, Dv] in q's dtype, final_state [B, H, Dk, Dv]
    fp32). ``initial_state`` [B, H, Dk, Dv] (None: zeros, fresh sequences) is not modified. With
    ``state_indices`` [B]: initial_state is the fp32 pool [num_slots, H, Dk, Dv], its rows state_indices
    overwritten in place by the final states, and None returned for them."""
    check_prefill(q, k, v, slope, cu_seqlens, initial_state, block_size, state_indices)
    if state_indices is not None:
        out, final_state = lightning_attention_prefill(q, k, v, slope, cu_seqlens, initial_state[state_indices],
                                                       block_size)
        initial_state[state_indices] = final_state
        return out, None
    num_seqs, num_heads, head_k, head_v = cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2], v.shape[2]
    if initial_state is None:
        initial_state = torch.zeros(num_seqs, num_heads, head_k, head_v, dtype=torch.float32, device=q.device)
    slope = slope.float()
    out = torch.empty(q.shape[0], num_heads, head_v, dtype=q.dtype, device=q.device)
    final_state = torch.empty(num_seqs, num_heads, head_k, head_v, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for i in range(num_seqs):
        start, end = bounds[i], bounds[i + 1]
        qs, ks, vs = (x[start:end].float().transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        o, final_state[i] = _prefill_sequence(qs, ks, vs, slope, initial_state[i].float(), block_size)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out, final_state


def lightning_attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                               state: torch.Tensor, *, state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence: q, k [B, H, Dk], v [B, H, Dv] -> o [B, H, Dv] in q's dtype.
    ``state`` [B, H, Dk, Dv] fp32 is updated in place: ``S <- exp(-slope) S + k^T v``, then ``o = q S``.
    With ``state_indices`` [B]: state is the pool [num_slots, H, Dk, Dv], rows state_indices updated in place."""
    check_decode(q, k, v, slope, state, state_indices)
    if state_indices is not None:
        rows = state[state_indices]
        out = lightning_attention_decode(q, k, v, slope, rows)
        state[state_indices] = rows
        return out
    decay = torch.exp(-slope.float())[None, :, None, None]
    state.mul_(decay).add_(k.float()[..., :, None] * v.float()[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q.float(), state).to(q.dtype)
