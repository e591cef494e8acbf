"""``ModelConfig``: the architecture facts lmplug needs, normalised from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmplug.interfaces.config_fields import ConfigReader, check_depth
from lmplug.interfaces.layer_types import layer_types_from_hf, mamba2_fields
from lmplug.interfaces.mla_config import MLA_TYPES, MLAConfig, mla_config_from_hf
from lmplug.interfaces.moe_config import MoEConfig, moe_config_from_hf
from lmplug.interfaces.state import ATTENTION

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
    # each layer's kind: "attention" or a state layer (``lmplug.interfaces.state``); (): all attention
    layer_types: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_states(self) -> bool:
        """Whether some layer carries a fixed-size state (linear attention, SSM)."""
        return any(kind != ATTENTION for kind in self.layer_types)

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the cache stores: the softmax-attention ones."""
        if not self.layer_types:
            return self.num_layers
        return sum(kind == ATTENTION for kind in self.layer_types)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """``where``: the file the config came from, named in every error (``ModelLoadError``)."""
        r = ConfigReader(cfg, where)
        check_depth(cfg, where)
        model_type = r.text("model_type")
        if model_type == "mamba2":  # no attention: heads are the SSM's (``layer_types``)
            return cls._mamba2(r, cfg)
        hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
        kv_heads = r.int("num_key_value_heads", heads)
        if heads % kv_heads and model_type not in MLA_TYPES:  # MLA has no KV heads to group
            r.fail("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
        head_dim = r.int("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                r.fail("num_attention_heads", f"({heads}) must divide hidden_size ({hidden}) "
                       "when the config gives no head_dim")
            head_dim = hidden // heads
        r.mapping("quantization_config")
        rope_theta, rope_scaling = _rope(r)
        num_layers = r.int("num_hidden_layers")
        qkv_bias = model_type in QKV_BIAS_TYPES and r.flag("qkv_bias", True)
        attention_bias = r.flag("attention_bias", False)
        return cls(
            model_type=model_type,
            vocab_size=r.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.int("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=r.number("rms_norm_eps", 1e-6),
            max_position_embeddings=r.int("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            attention_bias=qkv_bias or attention_bias,
            o_bias=model_type not in QKV_BIAS_TYPES and attention_bias,
            mlp_bias=r.flag("mlp_bias", False),
            qk_norm=model_type in QK_NORM_TYPES,
            sliding_window=_sliding_window(r),
            hidden_act=r.text("hidden_act", "silu"),
            moe=moe_config_from_hf(cfg, num_layers, where),
            mla=mla_config_from_hf(cfg, rope_scaling, where),
            layer_types=layer_types_from_hf(r, model_type, num_layers),
            raw=cfg,
        )

    @classmethod
    def _mamba2(cls, r: ConfigReader, cfg: dict[str, Any]) -> ModelConfig:
        num_layers = r.int("num_hidden_layers")
        return cls(model_type="mamba2", vocab_size=r.int("vocab_size"), num_layers=num_layers,
                   tie_word_embeddings=r.flag("tie_word_embeddings", False), hidden_act=r.text("hidden_act", "silu"),
                   layer_types=layer_types_from_hf(r, "mamba2", num_layers), raw=cfg, **mamba2_fields(r))


def _rope(r: ConfigReader) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 moved theta and scaling into `rope_parameters`.
    params = r.mapping("rope_parameters") or {}
    scaling = r.mapping("rope_scaling")
    theta = r.number("rope_theta", None)
    if theta is None:
        theta = ConfigReader(params, f"{r.where}: rope_parameters").number("rope_theta", 10000.0)
    if params and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    if scaling is not None:
        s = ConfigReader(scaling, f"{r.where}: rope_scaling")
        s.text("rope_type")
        s.number("factor", None)
        s.int("original_max_position_embeddings", None, high=1 << 24)
    return theta, scaling


def _sliding_window(r: ConfigReader) -> int | None:
    if r.cfg.get("model_type") in QWEN_TYPES and not r.flag("use_sliding_window", False):
        return None  # Qwen configs carry a window they do not use
    return r.int("sliding_window", None)
