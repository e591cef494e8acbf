"""The reference math the conformance suite compares backends against.

Written from the definitions, independently of every plugin (the core never
imports a plugin package): plain float64 loops over sequences and experts,
chosen for being obviously right rather than fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# -- attention ----------------------------------------------------------------------------------


def reference_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_lens: list[int],
    *,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
    gqa: str = "grouped",
    softcap: float | None = None,
) -> torch.Tensor:
    """Masked ``softmax(q k^T * scale) v`` per sequence, in float64.

    q: [T, H, D], the step's queries, sequences one after another.
    keys[i], values[i]: [S_i, Hkv, D], sequence i's whole context (cached + new).
    Query j of sequence i sits at position ``S_i - L_i + j`` and sees key
    positions ``p`` with ``p <= pos`` (causal) and ``p > pos - sliding_window``.
    ``gqa="grouped"``: query head h reads KV head ``h // (H // Hkv)`` (the
    convention of every Llama-family checkpoint); ``"interleaved"`` (h % Hkv)
    exists only to recognise that common mistake in a failing backend.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
    Returns [T, H, D] float64.
    """
    out = []
    start = 0
    for k, v, qlen in zip(keys, values, query_lens):
        qi = q[start : start + qlen].double()
        out.append(_one_sequence(qi, k.double(), v.double(), scale, sliding_window, causal, gqa, softcap))
        start += qlen
    return torch.cat(out) if out else q.new_zeros(q.shape, dtype=torch.float64)


def _one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    causal: bool,
    gqa: str,
    softcap: float | None = None,
) -> torch.Tensor:
    qlen, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    heads = torch.arange(num_heads)
    kv_head = heads // group if gqa == "grouped" else heads % num_kv_heads
    k, v = k[:, kv_head], v[:, kv_head]  # [S, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = visibility_mask(qlen, seq_len, window, causal)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def visibility_mask(
    qlen: int, seq_len: int, window: int | None, causal: bool = True
) -> torch.Tensor:
    """[L, S] bool, True where query j (at position S - L + j) may attend to key p."""
    q_pos = torch.arange(seq_len - qlen, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    visible = k_pos <= q_pos if causal else torch.ones(qlen, seq_len, dtype=torch.bool)
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return visible


# -- MoE ----------------------------------------------------------------------------------------


def reference_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float64, then the ``top_k`` largest (Mixtral / Qwen-MoE routing).

    Returns (expert ids [T, k] int64, weights [T, k] float64), largest weight first.
    """
    probs = torch.softmax(router_logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def reference_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Dense per-token, per-expert SwiGLU MLPs, weighted and summed, in float64.

    x [T, h]; w_gate_up [E, 2I, h] (gate rows first, then up); w_down [E, h, I].
    """
    x, w_gate_up, w_down = x.double(), w_gate_up.double(), w_down.double()
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(expert_ids[t].tolist(), weights[t].double().tolist()):
            gate_up = w_gate_up[e] @ x[t]
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += w * (w_down[e] @ hidden)
    return out


# -- linear layers --------------------------------------------------------------------------------


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b`` in float64 (W: [out, in], the dequantized weight)."""
    y = x.double() @ weight.double().T
    return y + bias.double() if bias is not None else y
