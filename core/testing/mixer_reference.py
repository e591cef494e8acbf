"""The float64 references of the mixer ops (``lmplug.interfaces.mixer``): one sequence, token by token.

Each function runs the recurrence of one op, as the interface's docstrings define it, over the
tokens of ONE sequence, starting from the state it is given, and returns the outputs and the final
state, all in float64. No chunking, no batching: the ``*_scan`` and ``*_update`` ops must equal
these loops, whatever form (chunked, blocked, fused) a backend computes them in.

- causal depthwise conv1d: ``y_t = act(bias + sum_j w[:, j] u_{t-K+1+j})`` over ``u`` = the K-1
  inputs kept in the conv state (oldest first), then the sequence's inputs; the new state is the
  last K-1 of ``u``;
- Mamba2's SSD (Dao & Gu 2024): ``dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)``,
  ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``, head h reading group
  ``h // (H / G)`` of B and C;
- the gated delta rule (Yang et al. 2024, Qwen3-Next): ``S' = exp(g_t) S_{t-1}``,
  ``S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T``, ``o_t = S_t^T q_t``, with q and k L2-normalised
  (``x / sqrt(|x|^2 + 1e-6)``, transformers' ``l2norm``), q scaled by ``scale`` (default
  ``Dk ** -0.5``), and value head h reading q/k head ``h // (Hv / Hk)``;
- lightning attention (MiniMax): ``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``.

Written independently of every plugin (the core never imports one).
"""

from __future__ import annotations

import math

import torch

L2NORM_EPS = 1e-6  # inside the square root, as transformers' (and flash-linear-attention's) l2norm


def _f64(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().cpu().double() for t in tensors]


def _group_index(num_heads: int, num_groups: int) -> torch.Tensor:
    """[H]: the group (or key head) each of ``num_heads`` heads reads: ``h // (H / G)``."""
    return torch.arange(num_heads) // (num_heads // num_groups)


# -- causal depthwise conv1d ---------------------------------------------------------------------


def conv1d_sequence(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, C], weight [C, K], bias [C] or None, state [C, K-1] (oldest input first) ->
    (y [L, C], new state [C, K-1]); ``activation`` "silu" (or "swish") or None."""
    x, weight, bias, state = _f64(x, weight, bias, state)
    width = weight.shape[1]
    inputs = torch.cat([state.T, x])  # [K-1+L, C]: input t of the sequence is row K-1+t
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        window = inputs[t : t + width]  # [K, C]: inputs t-K+1 .. t
        out = (weight.T * window).sum(dim=0)
        if bias is not None:
            out = out + bias
        if activation is not None:
            out = out * torch.sigmoid(out)
        y[t] = out
    return y, inputs[inputs.shape[0] - (width - 1) :].T.clone()


# -- Mamba2's SSD ----------------------------------------------------------------------------------


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """dt [..., H] -> float64 ``clamp(softplus(dt + dt_bias), *dt_limit)`` (softplus if asked)."""
    dt, dt_bias = _f64(dt, dt_bias)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = torch.logaddexp(dt, torch.zeros_like(dt))  # log(1 + e^dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def ssd_sequence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, H, P], dt [L, H], A [H], B and C [L, G, N], D [H] or None, state [H, P, N] ->
    (y [L, H, P], final state [H, P, N])."""
    step = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [L, H]
    x, A, B, C, D, state = _f64(x, A, B, C, D, state)
    group = _group_index(x.shape[1], B.shape[1])
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        b_t, c_t = B[t, group], C[t, group]  # [H, N]
        decay = torch.exp(step[t] * A)  # [H]
        state = decay[:, None, None] * state + (step[t][:, None] * x[t])[:, :, None] * b_t[:, None, :]
        y[t] = (state * c_t[:, None, :]).sum(dim=-1)
        if D is not None:
            y[t] = y[t] + D[:, None] * x[t]
    return y, state


# -- the gated delta rule ---------------------------------------------------------------------------


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gated_delta_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [L, Hk, Dk], v [L, Hv, Dv], g (log decay) and beta [L, Hv], state [Hv, Dk, Dv] ->
    (o [L, Hv, Dv], final state [Hv, Dk, Dv])."""
    q, k, v, g, beta, state = _f64(q, k, v, g, beta, state)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    head = _group_index(v.shape[1], k.shape[1])
    o = torch.empty_like(v)
    for t in range(v.shape[0]):
        q_t, k_t = q[t, head], k[t, head]  # [Hv, Dk]
        state = torch.exp(g[t])[:, None, None] * state
        predicted = (state * k_t[:, :, None]).sum(dim=1)  # S'^T k: [Hv, Dv]
        written = beta[t][:, None] * (v[t] - predicted)
        state = state + k_t[:, :, None] * written[:, None, :]
        o[t] = (state * q_t[:, :, None]).sum(dim=1)  # S^T q
    return o, state


# -- lightning attention ----------------------------------------------------------------------------


def lightning_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [L, H, Dk], v [L, H, Dv], slope [H], state [H, Dk, Dv] ->
    (o [L, H, Dv], final state [H, Dk, Dv])."""
    q, k, v, slope, state = _f64(q, k, v, slope, state)
    o = torch.empty_like(v)
    for t in range(v.shape[0]):
        state = torch.exp(-slope)[:, None, None] * state + k[t][:, :, None] * v[t][:, None, :]
        o[t] = (q[t][:, :, None] * state).sum(dim=1)  # q S
    return o, state
