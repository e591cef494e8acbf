"""``ModelConfig``: the architecture facts lmplug needs, normalised from an HF ``config.json``.

Which facts a model type implies (Qwen2's q/k/v biases, Qwen3's q/k norms, an MoE family's
expert keys...) is its architecture's knowledge (``Architecture.parse_config``, in its plugin);
the core keeps the typed, bounded readers those call, and no list of model types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmplug.interfaces.config_fields import ConfigReader, check_depth
from lmplug.interfaces.mla_config import MLAConfig, mla_config_from_hf
from lmplug.interfaces.moe_config import MoEConfig, MoEParser, moe_config_from_hf
from lmplug.interfaces.state import ATTENTION

LayerTypesParser = Callable[[ConfigReader, int], tuple[str, ...]]  # (reader, num_layers) -> kinds


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
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json", *, qkv_bias: bool = False,
                qk_norm: bool = False, window_flag: bool = False, grouped_kv: bool = True,
                moe: MoEParser | None = None, mla: bool = False,
                layer_types: LayerTypesParser | None = None) -> ModelConfig:
        """The standard decoder fields of ``cfg`` (Llama's keys and defaults); an architecture's
        ``parse_config`` calls it with what its model type implies. ``where``: the file the config
        came from, named in every error (``ModelLoadError``).

        ``qkv_bias``: q/k/v biases unless the config sets ``qkv_bias: false`` (Qwen2), and then
        ``attention_bias`` does not bias o_proj; ``qk_norm``: RMSNorm over each head of q and k;
        ``window_flag``: ``sliding_window`` applies only with ``use_sliding_window: true``;
        ``grouped_kv``: KV heads must divide the heads (MLA has none to group); ``moe``: the
        reader of its experts' keys (``moe_config``); ``mla``: read multi-head latent attention
        (``mla_config``); ``layer_types``: the reader of each layer's kind (``layer_types``)."""
        r = ConfigReader(cfg, where)
        check_depth(cfg, where)
        model_type = r.text("model_type")
        hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
        kv_heads = r.int("num_key_value_heads", heads)
        if heads % kv_heads and grouped_kv:
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
        qkv = qkv_bias and r.flag("qkv_bias", True)
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
            attention_bias=qkv or attention_bias,
            o_bias=not qkv_bias and attention_bias,
            mlp_bias=r.flag("mlp_bias", False),
            qk_norm=qk_norm,
            sliding_window=_sliding_window(r, window_flag),
            hidden_act=r.text("hidden_act", "silu"),
            moe=moe_config_from_hf(cfg, num_layers, moe, where) if moe is not None else None,
            mla=mla_config_from_hf(cfg, rope_scaling, where) if mla else None,
            layer_types=layer_types(r, num_layers) if layer_types is not None else (),
            raw=cfg,
        )


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


def _sliding_window(r: ConfigReader, window_flag: bool) -> int | None:
    if window_flag and not r.flag("use_sliding_window", False):
        return None  # Qwen configs carry a window they do not use
    return r.int("sliding_window", None)
