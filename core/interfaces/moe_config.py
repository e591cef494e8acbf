"""``MoEConfig``: the mixture-of-experts facts of a ``config.json`` (Mixtral, Qwen-MoE, DeepSeek).

Each family names the same ideas differently; one parser per family maps
them onto one record, so the MoE layer needs no per-model branches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmplug.errors import ModelLoadError
from lmplug.interfaces.moe import RoutingConfig


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    intermediate_size: int  # of one routed expert
    routing: RoutingConfig
    sparse_layers: frozenset[int]  # layers whose MLP is the MoE block; the others are dense
    shared_intermediate_size: int = 0  # the always-on shared expert(s); 0: none
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert is scaled by sigmoid(gate(x))
    correction_bias: bool = False  # DeepSeek-V3 noaux_tc: gate.e_score_correction_bias [E]

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def moe_config_from_hf(cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """The MoE record of an HF config, or None for a dense architecture. Raises ``KeyError``
    for a missing key and ``ModelLoadError`` for a value lmplug cannot run."""
    parse = _PARSERS.get(cfg.get("model_type", ""))
    if parse is None:
        return None
    try:
        return parse(cfg, num_layers)
    except ValueError as exc:
        raise ModelLoadError(f"config.json of a {cfg.get('model_type')!r} model: {exc}") from None


def _mixtral(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    # Mixtral: every layer sparse, softmax top-k renormalised; experts are intermediate_size wide
    return MoEConfig(
        num_experts=int(cfg["num_local_experts"]),
        intermediate_size=int(cfg["intermediate_size"]),
        routing=RoutingConfig(top_k=int(cfg["num_experts_per_tok"]), renormalize=True),
        sparse_layers=frozenset(range(num_layers)),
    )


def _qwen_moe(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    num_experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = {i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0}
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if cfg["model_type"] == "qwen2_moe" else 0
    return MoEConfig(
        num_experts=num_experts,
        intermediate_size=int(cfg["moe_intermediate_size"]),
        routing=RoutingConfig(top_k=int(cfg["num_experts_per_tok"]),
                              renormalize=bool(cfg.get("norm_topk_prob", False))),
        sparse_layers=frozenset(sparse),
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
    )


# DeepSeek topk_method -> group scoring (None: no group limit)
_DEEPSEEK_TOPK = {"greedy": None, "group_limited_greedy": "max", "noaux_tc": "top2_sum"}


def _deepseek(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    v3 = cfg["model_type"] == "deepseek_v3"
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in _DEEPSEEK_TOPK:
        raise ValueError(f"topk_method {method!r} is not supported; supported: {', '.join(_DEEPSEEK_TOPK)}")
    group_scoring = _DEEPSEEK_TOPK[method]
    grouped = group_scoring is not None
    inter = int(cfg["moe_intermediate_size"])
    first_dense, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
    routing = RoutingConfig(
        top_k=int(cfg["num_experts_per_tok"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        scoring=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        n_group=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
        group_scoring=group_scoring or "max",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )
    return MoEConfig(
        num_experts=int(cfg["n_routed_experts"]),
        intermediate_size=inter,
        routing=routing,
        sparse_layers=frozenset(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
        shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
        correction_bias=method == "noaux_tc",
    )


_PARSERS: dict[str, Callable[[dict[str, Any], int], MoEConfig]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}
