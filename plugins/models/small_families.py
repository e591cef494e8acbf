"""SmolLM3, OLMo 2 and Granite: Llama decoders with one difference each.

- SmolLM3: no position encoding (NoPE) in every fourth layer (``no_rope_layers``);
- OLMo 2: norms after each block, not before (``h = x + norm(attn(x))``), and q/k norms over all
  heads at once;
- Granite: the embedding, each block's residual, the attention scores and the logits scaled by
  the config's multipliers.
"""

from __future__ import annotations

from lmplug_models.blocks import (
    SLIDING,
    AttentionShape,
    FlexAttention,
    FlexDecoder,
    FlexLayer,
    GatedMLP,
    layer_kinds,
)

from lmplug.api import ConfigReader, LayerAttention, ModelConfig


def smollm3_ropes(cfg: ModelConfig, where: str = "config.json") -> tuple[bool, ...]:
    """Per layer, whether it applies RoPE (``no_rope_layers``: 1 = RoPE, 0 = NoPE)."""
    r = ConfigReader(cfg.raw, where)
    raw = cfg.raw.get("no_rope_layers")
    if raw is None:
        interval = r.int("no_rope_layer_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(cfg.num_layers))
    if not isinstance(raw, list) or len(raw) != cfg.num_layers or any(v not in (0, 1) for v in raw):
        r.fail("no_rope_layers", f"must list {cfg.num_layers} entries (num_hidden_layers) of 0 or 1")
    return tuple(bool(v) for v in raw)


def smollm3_layers(cfg: ModelConfig) -> tuple[LayerAttention, ...]:
    """SmolLM3's windows where ``use_sliding_window`` (sliding layers of ``layer_types``)."""
    r = ConfigReader(cfg.raw)
    window = r.int("sliding_window", None) if r.flag("use_sliding_window", False) else None
    if window is None:
        return ()
    kinds = layer_kinds(cfg, lambda i: SLIDING)
    return tuple(LayerAttention(cfg.head_dim ** -0.5, window if k == SLIDING else None) for k in kinds)


class SmolLM3ForCausalLM(FlexDecoder):
    def new_layer(self, index, dtype, quant, attention, kv_layer=None):
        cfg = self.config
        rope = self.layer_rope() if smollm3_ropes(cfg)[index] else None
        attn = FlexAttention(cfg, index if kv_layer is None else kv_layer, dtype, quant, attention, self.tp,
                             AttentionShape(rope))
        return FlexLayer(cfg, attn, GatedMLP(cfg, dtype, quant, self.tp, cfg.hidden_act), dtype, "pre")


class Olmo2ForCausalLM(FlexDecoder):
    def new_layer(self, index, dtype, quant, attention, kv_layer=None):
        cfg = self.config
        attn = FlexAttention(cfg, index if kv_layer is None else kv_layer, dtype, quant, attention, self.tp,
                             AttentionShape(self.layer_rope(), qk_norm="full"))
        return FlexLayer(cfg, attn, GatedMLP(cfg, dtype, quant, self.tp, cfg.hidden_act), dtype, "post")


def granite_multipliers(cfg: ModelConfig, where: str = "config.json") -> dict[str, float]:
    r = ConfigReader(cfg.raw, where)
    return {"embedding": r.number("embedding_multiplier", 1.0), "residual": r.number("residual_multiplier", 1.0),
            "attention": r.number("attention_multiplier", cfg.head_dim ** -0.5),
            "logits": r.number("logits_scaling", 1.0)}


class GraniteForCausalLM(FlexDecoder):
    def __init__(self, cfg, dtype, quant, attention, max_model_len, *, parallel=None) -> None:
        super().__init__(cfg, dtype, quant, attention, max_model_len, parallel=parallel)
        multipliers = granite_multipliers(cfg)
        self.embedding_multiplier, self.logits_divisor = multipliers["embedding"], multipliers["logits"]

    def new_layer(self, index, dtype, quant, attention, kv_layer=None):
        cfg = self.config
        attn = FlexAttention(cfg, index if kv_layer is None else kv_layer, dtype, quant, attention, self.tp,
                             AttentionShape(self.layer_rope()))
        return FlexLayer(cfg, attn, GatedMLP(cfg, dtype, quant, self.tp, cfg.hidden_act), dtype, "pre",
                         residual_multiplier=granite_multipliers(cfg)["residual"])
