"""``ModelConfig``: the architecture facts lmplug needs, normalised from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmplug.errors import ModelLoadError
from lmplug.interfaces.mla_config import MLAConfig, mla_config_from_hf
from lmplug.interfaces.moe_config import MoEConfig, moe_config_from_hf

QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")  # q/k/v biases unless the config says otherwise
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
QWEN_TYPES = QKV_BIAS_TYPES + QK_NORM_TYPES  # sliding_window applies only with use_sliding_window


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2: always)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    hidden_act: str = "silu"
    moe: MoEConfig | None = None  # mixture-of-experts layers (None: a dense model)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2/V3); None: ordinary
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            rope_theta, rope_scaling = _rope(cfg)
            num_layers = int(cfg["num_hidden_layers"])
            qkv_bias = model_type in QKV_BIAS_TYPES and bool(cfg.get("qkv_bias", True))
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
                o_bias=model_type not in QKV_BIAS_TYPES and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type in QK_NORM_TYPES,
                sliding_window=_sliding_window(cfg),
                hidden_act=cfg.get("hidden_act", "silu"),
                moe=moe_config_from_hf(cfg, num_layers),
                mla=mla_config_from_hf(cfg, rope_scaling),
                raw=cfg,
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json of a {model_type!r} model lacks {exc.args[0]!r}") from None


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 moved theta and scaling into `rope_parameters`.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if params and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(theta), scaling


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in QWEN_TYPES and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None
