"""The gated delta rule (Qwen3-Next's linear attention) in PyTorch: the CPU path and the kernels' reference.

Per value head, a state ``S [Dk, Dv]`` (fp32) is carried along a sequence; at token t, with
``q_t, k_t`` L2-normalised (``use_qk_l2norm``), ``q_t`` scaled by ``scale`` (default ``Dk**-0.5``),
log-decay ``g_t <= 0`` and write strength ``beta_t`` in (0, 1)::

    S   <- exp(g_t) * S                        # decay
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T  # delta rule: write the part of v_t S does not predict
    o_t  = S^T q_t

(Yang et al., "Gated Delta Networks", 2024; transformers' ``torch_recurrent_gated_delta_rule``.)
In Qwen3-Next ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``; the caller
computes both. Heads are grouped: q/k carry ``Hk`` heads, v/g/beta/state ``Hv`` (a multiple), and
value head ``h`` reads q/k head ``h // (Hv // Hk)`` (transformers' ``repeat_interleave``).

The chunked form (``chunk_gated_delta_rule``): within a chunk of C tokens, with ``G_i`` the inclusive
cumulative sum of g and ``D_ij = exp(G_i - G_j)`` for ``j <= i``, the C sequential updates collapse
into matmuls (the WY / UT transform). With ``A = strictly_lower(diag(beta) K K^T * D)``::

    U = (I + A)^-1 diag(beta) V                 # the values each token writes, before the old state
    W = (I + A)^-1 diag(beta exp(G)) K          # how much of the old state each token's write removes
    V' = U - W S_0
    O  = diag(exp(G)) Q S_0 + lower(Q K^T * D) V'   (lower: diagonal included)
    S_C = exp(G_C) S_0 + (diag(exp(G_C - G)) K)^T V'

Layout: sequences flattened along dim 0 (``[T, ...]``) with ``cu_seqlens [B+1]``; each is padded to
whole chunks of the longest one with ``k = v = beta = g = 0`` tokens, which leave a state unchanged
(no decay, no write), so one vectorized pass serves every sequence. Outputs take q's dtype; states
are fp32 ``[B, Hv, Dk, Dv]``.

- ``chunk_gated_delta_rule``: prefill / chunked prefill, chunked form;
- ``recurrent_gated_delta_rule``: the same by the plain per-token recurrence (the ground truth of
  the chunked form);
- ``fused_recurrent_gated_delta_rule_update``: decode, one token per sequence, state in place.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6  # inside the rsqrt, as transformers' (and FLA's) l2norm


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def check_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, what: str) -> int:
    """Shapes of q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv]; returns the group size Hv // Hk."""
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3:
        raise ValueError(f"{what}: q and k must be [tokens, Hk, Dk] and v [tokens, Hv, Dv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    if v.shape[0] != q.shape[0] or num_k_heads == 0 or num_v_heads % num_k_heads:
        raise ValueError(f"{what}: v {tuple(v.shape)} must have q's tokens and a multiple of its "
                         f"{num_k_heads} heads")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"{what}: g and beta must be [tokens, Hv] = {tuple(v.shape[:2])}; got "
                         f"{tuple(g.shape)} and {tuple(beta.shape)}")
    return num_v_heads // num_k_heads


def check_state(state: torch.Tensor, batch: int, k: torch.Tensor, v: torch.Tensor, name: str,
                what: str) -> None:
    want = (batch, v.shape[1], k.shape[2], v.shape[2])
    if tuple(state.shape) != want or state.dtype != torch.float32:
        raise ValueError(f"{what}: {name} must be float32 [B, Hv, Dk, Dv] = {want}; got "
                         f"{state.dtype} {tuple(state.shape)}")


def _qk(q: torch.Tensor, k: torch.Tensor, group: int, use_qk_l2norm: bool,
        scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> fp32 [..., Hv, Dk]: normalised, q scaled, heads repeated per group."""
    q, k = (l2_normalize(q), l2_normalize(k)) if use_qk_l2norm else (q.float(), k.float())
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


def _padded(x: torch.Tensor, cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[T, ...] flattened sequences -> [B, length, ...], zeros past each sequence's end."""
    starts, lens = cu_seqlens[:-1].long(), cu_seqlens.diff().long()
    pos = torch.arange(length, device=x.device)
    valid = pos[None, :] < lens[:, None]  # [B, L]
    rows = torch.where(valid, starts[:, None] + pos[None, :], 0)
    out = x[rows.flatten()].reshape(*rows.shape, *x.shape[1:])
    return torch.where(valid.reshape(*valid.shape, *[1] * (x.dim() - 1)), out, 0)


def _unpadded(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B, L, ...] -> [T, ...]: the inverse of ``_padded``."""
    lens = cu_seqlens.diff().long()
    valid = torch.arange(x.shape[1], device=x.device)[None, :] < lens[:, None]
    return x[valid]


def _inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, use_qk_l2norm: bool,
            scale: float | None, length: int, what: str) -> tuple[torch.Tensor, ...]:
    """The padded fp32 operands q, k, v, g, beta [B, Hv, L, ...] and a copy of the starting state
    [B, Hv, Dk, Dv] (zeros for None)."""
    group = check_gated_delta(q, k, v, g, beta, what)
    batch = cu_seqlens.numel() - 1
    qf, kf = _qk(q, k, group, use_qk_l2norm, scale)
    qf, kf, vf, gf, bf = (_padded(x, cu_seqlens, length).transpose(1, 2)
                          for x in (qf, kf, v.float(), g.float(), beta.float()))
    if initial_state is None:
        state = torch.zeros(batch, v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32, device=v.device)
    else:
        check_state(initial_state, batch, k, v, "initial_state", what)
        state = initial_state.clone()
    return qf, kf, vf, gf, bf, state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor,
                           initial_state: torch.Tensor | None = None, chunk_size: int = 64,
                           use_qk_l2norm: bool = True,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g (log-decay), beta [T, Hv], cu_seqlens [B+1], initial_state
    (fp32 [B, Hv, Dk, Dv], None: zeros) -> (o [T, Hv, Dv] in q's dtype, final_state fp32 [B, Hv, Dk, Dv])."""
    lens = cu_seqlens.diff()
    num_chunks = -(-int(lens.max()) // chunk_size) if lens.numel() else 0
    q_, k_, v_, g_, b_, state = _inputs(q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale,
                                        num_chunks * chunk_size, "chunk_gated_delta_rule")
    batch, heads = k_.shape[:2]

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, H, L, ...] -> [B, H, N, C, ...]
        return x.reshape(batch, heads, num_chunks, chunk_size, *x.shape[3:])

    q_, k_, v_, g_, b_ = (chunked(x) for x in (q_, k_, v_, g_, b_))
    cum = g_.cumsum(dim=-1)  # G [B, H, N, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # D_ij = exp(G_i - G_j), i >= j; above the diagonal the exponent could overflow, so mask first
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    eye = torch.eye(chunk_size, dtype=torch.float32, device=q.device)
    system = eye + (b_[..., None] * (k_ @ k_.transpose(-1, -2)) * decay).tril(-1)  # I + A
    u = torch.linalg.solve_triangular(system, b_[..., None] * v_, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (b_ * cum.exp())[..., None] * k_, upper=False,
                                      unitriangular=True)
    intra = (q_ @ k_.transpose(-1, -2)) * decay  # [B, H, N, C, C], zero above the diagonal
    q_read = q_ * cum.exp()[..., None]
    k_write = k_ * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v_)
    for n in range(num_chunks):
        v_new = u[:, :, n] - w[:, :, n] @ state
        out[:, :, n] = q_read[:, :, n] @ state + intra[:, :, n] @ v_new
        state = state * cum[:, :, n, -1, None, None].exp() + k_write[:, :, n].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, num_chunks * chunk_size, -1).transpose(1, 2)
    return _unpadded(out, cu_seqlens).to(q.dtype), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, cu_seqlens: torch.Tensor,
                               initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule``'s arguments and results, by the per-token recurrence: every sequence
    takes its step t at once (``_step``; past its end, zero tokens leave its state alone)."""
    length = int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0
    q_, k_, v_, g_, b_, state = _inputs(q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale,
                                        length, "recurrent_gated_delta_rule")
    out = torch.empty_like(v_)
    for t in range(length):
        out[:, :, t] = _step(q_[:, :, t], k_[:, :, t], v_[:, :, t], g_[:, :, t], b_[:, :, t], state)
    return _unpadded(out.transpose(1, 2), cu_seqlens).to(q.dtype), state


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor) -> torch.Tensor:
    """One token of every sequence: fp32 q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H]; state
    [B, H, Dk, Dv] updated in place; returns o [B, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    state.add_(k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def fused_recurrent_gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                            g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                            use_qk_l2norm: bool = True,
                                            scale: float | None = None) -> torch.Tensor:
    """Decode: one token per sequence. q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; ``state``
    (fp32 [B, Hv, Dk, Dv]) is updated IN PLACE; returns o [B, Hv, Dv] in q's dtype."""
    what = "fused_recurrent_gated_delta_rule_update"
    group = check_gated_delta(q, k, v, g, beta, what)
    check_state(state, q.shape[0], k, v, "state", what)
    qf, kf = _qk(q, k, group, use_qk_l2norm, scale)
    return _step(qf, kf, v.float(), g.float(), beta.float(), state).to(q.dtype)
