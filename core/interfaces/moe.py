"""MoE backends: a router (logits -> experts, weights) and an expert executor.

A model's MoE layer calls ``route`` then ``experts``::

    ids, weights = backend.route(router_logits, routing, correction_bias=bias)  # [T, k] each
    out = backend.experts(x, ids, weights, w_gate_up, w_down)                    # [T, h]

``routing`` is the model's ``RoutingConfig``, read from its ``config.json``;
the layer owns the weights (every expert stacked along a leading ``E`` axis)
and the backend only computes.

Under expert parallelism (``parallel.expert_parallel``) a rank holds only some
experts; the layer then calls ``experts`` with just the token-expert pairs
routed to them, one row per pair (``x[tokens]``, ids ``[P, 1]`` counted from the
rank's first expert, weights ``[P, 1]``), and sums the rows per token itself. A
backend therefore never sees an expert id outside ``[0, E)`` of the weights it is
given and needs nothing for expert parallelism.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORINGS = ("max", "top2_sum")


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits pick ``top_k`` experts per token and weigh them.

    - ``scoring``: ``softmax`` over all experts (Mixtral, Qwen-MoE, DeepSeek-V2) or an
      independent ``sigmoid`` per expert (DeepSeek-V3). Experts are chosen on
      ``score + correction_bias`` (V3's ``e_score_correction_bias``, a per-layer tensor
      passed to ``route``), weighted by the score alone.
    - ``n_group`` / ``topk_group``: experts form ``n_group`` equal groups and a token may
      use only its ``topk_group`` best groups, a group scored by its best expert
      (``group_scoring="max"``, DeepSeek-V2 ``group_limited_greedy``) or the sum of its
      best two (``"top2_sum"``, V3 ``noaux_tc``). ``n_group=1``: no limit.
    - ``renormalize``: the k weights are divided by their sum (Mixtral; Qwen's and
      DeepSeek's ``norm_topk_prob``); then multiplied by ``routed_scaling_factor``.

    Ties go to the lower expert id (and the lower group id).
    """

    top_k: int
    renormalize: bool = True
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_scoring: Literal["max", "top2_sum"] = "max"
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"RoutingConfig: top_k must be >= 1, got {self.top_k}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"RoutingConfig: scoring {self.scoring!r} is not one of {', '.join(SCORINGS)}")
        if self.group_scoring not in GROUP_SCORINGS:
            raise ValueError(f"RoutingConfig: group_scoring {self.group_scoring!r} is not one of "
                             f"{', '.join(GROUP_SCORINGS)}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"RoutingConfig: need 1 <= topk_group <= n_group, got topk_group="
                             f"{self.topk_group}, n_group={self.n_group}")

    @classmethod
    def of(cls, routing: RoutingConfig | int, renormalize: bool = True) -> RoutingConfig:
        """``routing`` itself, or for a plain ``top_k`` the softmax top-k rule."""
        return routing if isinstance(routing, RoutingConfig) else cls(int(routing), bool(renormalize))


class MoEBackend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @abstractmethod
    def route(self, router_logits: torch.Tensor, routing: RoutingConfig | int, renormalize: bool = True, *,
              correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (expert ids [T, k] int64, weights [T, k] float32).

        ``routing`` is the model's rule; a plain int ``k`` is short for
        ``RoutingConfig(top_k=k, renormalize=renormalize)`` (softmax top-k, as Mixtral
        and Qwen-MoE route): normalise with ``RoutingConfig.of(routing, renormalize)``.
        ``correction_bias`` [E] shifts the scores experts are chosen on (DeepSeek-V3).
        """

    @abstractmethod
    def experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """x [T, h]; expert_ids, weights [T, k]; w_gate_up [E, 2I, h] (gate rows, then up);
        w_down [E, h, I] -> [T, h] in x's dtype: each token's SwiGLU experts, weighted and summed.

        Experts a quant method keeps packed come instead as two sequences of E modules,
        ``w_gate_up[e](x [n, h]) -> [n, 2I]`` and ``w_down[e](h [n, I]) -> [n, h]`` (each a
        quantized ``Linear``); only a backend whose capabilities list the feature
        ``packed_experts`` is given those (the model refuses the others at load)."""
