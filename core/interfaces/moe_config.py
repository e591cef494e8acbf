"""``MoEConfig``: the mixture-of-experts facts of a ``config.json`` (Mixtral, Qwen-MoE, DeepSeek).

Each family names the same ideas differently; one reader per naming scheme maps them onto one
record, so the MoE layer needs no per-model branches. Which scheme a model type uses is its
architecture's knowledge (``ModelConfig.from_hf(moe=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmplug.errors import ModelLoadError
from lmplug.interfaces.config_fields import ConfigReader
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


MoEParser = Callable[[ConfigReader, int], MoEConfig]  # (reader, layers incl. MTP ones) -> record


def moe_config_from_hf(cfg: dict[str, Any], num_layers: int, parse: MoEParser,
                       where: str = "config.json") -> MoEConfig:
    """The MoE record of an HF config, read by ``parse`` (``mixtral_moe``, ``qwen_moe``,
    ``deepseek_moe``, or an architecture's own). Raises ``ModelLoadError`` naming ``where`` and
    the key for a missing or bad value, or one lmplug cannot run."""
    r = ConfigReader(cfg, where)
    # multi-token-prediction layers follow the last decoder layer and have its kind of MLP
    # (DeepSeek-V3: layer 61 is an MoE layer), so the sparse layers cover them too
    mtp_layers = r.int("num_nextn_predict_layers", 0, low=0)
    try:
        moe = parse(r, num_layers + mtp_layers)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: a {cfg.get('model_type')!r} model: {exc}") from None
    if 0 < moe.num_experts < moe.routing.top_k:
        r.fail("num_experts_per_tok", f"({moe.routing.top_k}) exceeds the number of experts ({moe.num_experts})")
    return moe


def mixtral_moe(r: ConfigReader, num_layers: int) -> MoEConfig:
    # Mixtral: every layer sparse, softmax top-k renormalised; experts are intermediate_size wide
    return MoEConfig(
        num_experts=r.int("num_local_experts"),
        intermediate_size=r.int("intermediate_size"),
        routing=RoutingConfig(top_k=r.int("num_experts_per_tok"), renormalize=True),
        sparse_layers=frozenset(range(num_layers)),
    )


def qwen_moe(r: ConfigReader, num_layers: int, gated_shared: bool = False) -> MoEConfig:
    """Qwen-MoE's keys; ``gated_shared``: a shared expert scaled by sigmoid(gate(x)) (Qwen2-MoE,
    Qwen3-Next; Qwen3-MoE has none)."""
    cfg = r.cfg
    num_experts = r.int("num_experts" if "num_experts" in cfg else "num_local_experts", low=0)
    step = r.int("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        r.fail("mlp_only_layers", "must be a list of layer numbers")
    dense = set(dense)
    sparse = {i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0}
    shared = r.int("shared_expert_intermediate_size", 0, low=0) if gated_shared else 0
    return MoEConfig(
        num_experts=num_experts,
        intermediate_size=r.int("moe_intermediate_size"),
        routing=RoutingConfig(top_k=r.int("num_experts_per_tok"),
                              renormalize=r.flag("norm_topk_prob", False)),
        sparse_layers=frozenset(sparse),
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
    )


# DeepSeek topk_method -> group scoring (None: no group limit)
_DEEPSEEK_TOPK = {"greedy": None, "group_limited_greedy": "max", "noaux_tc": "top2_sum"}


def deepseek_moe(r: ConfigReader, num_layers: int, v3: bool = False) -> MoEConfig:
    """DeepSeek's keys; ``v3``: V3's defaults (noaux_tc routing, sigmoid scores)."""
    method = r.text("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in _DEEPSEEK_TOPK:
        raise ValueError(f"topk_method {method!r} is not supported; supported: {', '.join(_DEEPSEEK_TOPK)}")
    group_scoring = _DEEPSEEK_TOPK[method]
    grouped = group_scoring is not None
    inter = r.int("moe_intermediate_size")
    first_dense, freq = r.int("first_k_dense_replace", 0, low=0), r.int("moe_layer_freq", 1)
    routing = RoutingConfig(
        top_k=r.int("num_experts_per_tok"),
        renormalize=r.flag("norm_topk_prob", False),
        scoring=r.text("scoring_func") or ("sigmoid" if v3 else "softmax"),
        n_group=r.int("n_group", 1) if grouped else 1,
        topk_group=r.int("topk_group", 1) if grouped else 1,
        group_scoring=group_scoring or "max",
        routed_scaling_factor=r.number("routed_scaling_factor", 1.0),
    )
    return MoEConfig(
        num_experts=r.int("n_routed_experts"),
        intermediate_size=inter,
        routing=routing,
        sparse_layers=frozenset(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
        shared_intermediate_size=inter * r.int("n_shared_experts", 0, low=0),
        correction_bias=method == "noaux_tc",
    )
