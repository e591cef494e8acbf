"""``reference``: PyTorch MoE experts, the CPU default and the ground truth of the Triton kernels.

The token-expert pairs are sorted by expert, so each expert that received
tokens runs one gate/up and one down matmul over all of its tokens (experts
with no token cost nothing); the weighted outputs are summed back per token
with one ``index_add_``. There is no loop over tokens. Packed quantized experts
(``dequantize_at_load: false``) come as per-expert quantized linears, each of which
dequantizes its weights when called, so memory stays packed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from lmplug_moe.routing import select_experts

from lmplug.api import BackendOptions, Capabilities, MoEBackend, RoutingConfig


def check_experts_args(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` unless the shapes agree: x [T, h], ids/weights [T, k],
    w_gate_up [E, 2I, h], w_down [E, h, I]."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"{what}: need x [T, h], w_gate_up [E, 2I, h], w_down [E, h, I]; got "
                         f"{tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    num_experts, two_inter, hidden = w_gate_up.shape
    if x.shape[1] != hidden or tuple(w_down.shape) != (num_experts, hidden, two_inter // 2) or two_inter % 2:
        raise ValueError(f"{what}: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)} and w_down "
                         f"{tuple(w_down.shape)} do not agree (x [T, h], w_gate_up [E, 2I, h], w_down [E, h, I])")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or weights.shape != expert_ids.shape:
        raise ValueError(f"{what}: expert_ids and weights must both be [T={x.shape[0]}, k], got "
                         f"{tuple(expert_ids.shape)} and {tuple(weights.shape)}")
    if expert_ids.dtype.is_floating_point:
        raise ValueError(f"{what}: expert_ids must be an integer tensor, got {expert_ids.dtype}")


def reference_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                      w_gate_up: torch.Tensor | Sequence[Callable], w_down: torch.Tensor | Sequence[Callable],
                      ) -> torch.Tensor:
    """Each token's SwiGLU experts, weighted and summed: x [T, h] -> [T, h] (x's dtype).

    ``w_gate_up`` / ``w_down`` are the stacked weights, or per-expert modules (packed
    quantized experts, which dequantize in their own ``forward`` on each call)."""
    stacked = isinstance(w_gate_up, torch.Tensor)
    if stacked:
        check_experts_args(x, expert_ids, weights, w_gate_up, w_down, "reference_experts")
    elif len(w_gate_up) != len(w_down):
        raise ValueError(f"reference_experts: {len(w_gate_up)} gate/up modules but {len(w_down)} down modules")
    num_tokens, top_k = expert_ids.shape
    num_experts = w_gate_up.shape[0] if stacked else len(w_gate_up)
    flat = expert_ids.reshape(-1).long()  # [T*k] pair p = (token p // k, slot p % k)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x[tokens]  # [T*k, h], in expert order
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if not n:  # experts without a token are skipped
            continue
        if stacked:
            gate, up = F.linear(xs[start:start + n], w_gate_up[e]).chunk(2, dim=-1)  # [n, I] each
            torch.mm(F.silu(gate, inplace=True).mul_(up), w_down[e].t(), out=ys[start:start + n])
        else:
            gate, up = w_gate_up[e](xs[start:start + n]).chunk(2, dim=-1)
            ys[start:start + n] = w_down[e](F.silu(gate).mul_(up))
        start += n
    # weigh and sum in float32 (in place for float32 inputs)
    scaled = ys.float().mul_(weights.reshape(-1)[order].float().unsqueeze(1))  # [T*k, h]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, scaled).to(x.dtype)


class ReferenceMoE(MoEBackend):
    """PyTorch routing and experts; runs anywhere, the default on CPU; the one backend that runs
    packed quantized experts (each expert's quantized ``Linear``, dequantized per call)."""

    name = "reference"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), priority=10,
                                features=frozenset({"packed_experts"}))
    Options = BackendOptions

    def route(self, router_logits: torch.Tensor, routing: RoutingConfig | int, renormalize: bool = True, *,
              correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(router_logits, RoutingConfig.of(routing, renormalize), correction_bias)

    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                w_gate_up: torch.Tensor | Sequence[Callable],
                w_down: torch.Tensor | Sequence[Callable]) -> torch.Tensor:
        return reference_experts(x, expert_ids, weights, w_gate_up, w_down)
