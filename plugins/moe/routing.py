"""Routing shared by the moe backends: router logits -> (expert ids, weights).

One function covers the published rules (``RoutingConfig`` names them):

- Mixtral: softmax over all experts, top-k, renormalise the k weights;
- Qwen2-MoE / Qwen3-MoE: the same, renormalised only when ``norm_topk_prob``;
- DeepSeek-V2: softmax, optionally ``group_limited_greedy`` (a token uses only its
  ``topk_group`` groups with the best expert), times ``routed_scaling_factor``;
- DeepSeek-V3 (``noaux_tc``): sigmoid scores; experts are chosen on score +
  ``e_score_correction_bias`` within the groups whose best two such scores sum
  highest, and weighted by the plain score (renormalised), times the scaling factor.

Scores are computed in float32 whatever the logits' dtype. Ties go to the lower
id: a stable descending sort, not ``torch.topk``, whose tie order is unspecified.
"""

from __future__ import annotations

import torch

from lmplug.api import RoutingConfig


def select_experts(router_logits: torch.Tensor, routing: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (expert ids [T, k] int64, weights [T, k] float32), best first."""
    check_routing(router_logits, routing, correction_bias)
    scores = _scores(router_logits.float(), routing.scoring)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.n_group > 1:
        choice = limit_to_groups(choice, routing.n_group, routing.topk_group, routing.group_scoring)
    ids = top_k_ids(choice, routing.top_k)  # [T, k]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        # the epsilon keeps all-zero sigmoid weights finite; next to a sum of O(1) it rounds away
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return ids, weights


def top_k_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """Column ids of the ``k`` largest values per row, largest first; ties to the lower id."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int, group_scoring: str) -> torch.Tensor:
    """Mask (to -inf) the experts outside each token's ``topk_group`` best groups: [T, E] -> [T, E]."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
    if group_scoring == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.amax(dim=-1)  # [T, G]
    keep = top_k_ids(group_scores, topk_group)  # [T, topk_group]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


def check_routing(router_logits: torch.Tensor, routing: RoutingConfig,
                  correction_bias: torch.Tensor | None) -> None:
    """Raise ``ValueError`` when the logits cannot be routed by ``routing``."""
    if router_logits.dim() != 2:
        raise ValueError(f"route: router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if num_experts % routing.n_group:
        raise ValueError(f"route: {num_experts} experts do not split into n_group={routing.n_group} groups")
    group_size = num_experts // routing.n_group
    if routing.top_k > routing.topk_group * group_size:
        raise ValueError(f"route: top_k={routing.top_k} exceeds the {routing.topk_group * group_size} experts "
                         f"of topk_group={routing.topk_group} groups of {group_size}")
    if routing.group_scoring == "top2_sum" and routing.n_group > 1 and group_size < 2:
        raise ValueError("route: group_scoring='top2_sum' needs at least 2 experts per group")
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"route: correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}")


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
