"""Gemma 2 and Gemma 3 (text): sandwich norms (before and after each block), ``1 + w`` RMSNorm,
the embedding times sqrt(hidden), GeGLU with tanh GELU, a softmax scale of
``query_pre_attn_scalar ** -0.5``, sliding-window layers between global ones (Gemma 2 1:1, Gemma 3
5:1) with their own RoPE theta (Gemma 3), attention-logit and final-logit soft-caps (Gemma 2), and
per-head q/k norms (Gemma 3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lmplug_models.blocks import (
    FULL,
    SLIDING,
    AttentionShape,
    FlexAttention,
    FlexDecoder,
    FlexLayer,
    GatedMLP,
    OffsetRMSNorm,
    layer_kinds,
    rope_of,
)

from lmplug.api import ConfigReader, LayerAttention, ModelConfig

GEMMA3 = "gemma3_text"


@dataclass(frozen=True)
class GemmaOptions:
    scale: float
    attn_softcap: float | None
    final_softcap: float | None
    window: int | None
    kinds: tuple[str, ...]  # per layer: SLIDING or FULL
    ropes: dict  # kind -> rope_parameters (theta, scaling)
    activation: str


def gemma_options(cfg: ModelConfig, where: str = "config.json") -> GemmaOptions:
    """The Gemma facts of ``cfg.raw`` (config.json), each checked (``ModelLoadError`` naming ``where``)."""
    r = ConfigReader(cfg.raw, where)
    gemma3 = cfg.model_type == GEMMA3
    if gemma3:
        pattern = r.int("sliding_window_pattern", None) or r.int("_sliding_window_pattern", 6)
        kinds = layer_kinds(cfg, lambda i: FULL if (i + 1) % pattern == 0 else SLIDING)
    else:
        kinds = layer_kinds(cfg, lambda i: SLIDING if i % 2 == 0 else FULL)
    params = cfg.raw.get("rope_parameters")
    full = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):  # transformers 5: one per kind
        ropes = {FULL: params[FULL], SLIDING: params.get(SLIDING) or params[FULL]}
    elif gemma3:
        ropes = {FULL: full, SLIDING: {"rope_theta": r.number("rope_local_base_freq", 10000.0)}}
    else:
        ropes = {FULL: full, SLIDING: full}
    activation = r.text("hidden_activation", None) or r.text("hidden_act", "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        r.fail("hidden_activation", f"is {activation!r}; the {cfg.model_type} architecture runs gelu_pytorch_tanh")
    return GemmaOptions(scale=r.number("query_pre_attn_scalar", cfg.head_dim) ** -0.5,
                        attn_softcap=r.number("attn_logit_softcapping", None),
                        final_softcap=r.number("final_logit_softcapping", None),
                        window=r.int("sliding_window", None), kinds=kinds, ropes=ropes, activation=activation)


def gemma_layers(cfg: ModelConfig) -> tuple[LayerAttention, ...]:
    """How each layer attends: the scale, the window of sliding layers, the soft-cap."""
    opts = gemma_options(cfg)
    return tuple(LayerAttention(opts.scale, opts.window if kind == SLIDING else None, opts.attn_softcap)
                 for kind in opts.kinds)


class GemmaForCausalLM(FlexDecoder):
    """Gemma 2 and Gemma 3 text (``model_type`` gemma2, gemma3_text)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant, attention, max_model_len: int, *,
                 parallel=None) -> None:
        opts = gemma_options(cfg)
        max_position = max(max_model_len, cfg.max_position_embeddings)
        self._gemma = opts
        self._ropes = {kind: rope_of(cfg.head_dim, max_position, params, dtype) for kind, params in opts.ropes.items()}
        super().__init__(cfg, dtype, quant, attention, max_model_len, parallel=parallel)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if self.tp.stage.last else None
        self.embedding_multiplier = cfg.hidden_size ** 0.5
        self.final_softcap = opts.final_softcap

    def new_layer(self, index, dtype, quant, attention, kv_layer=None):
        cfg, opts = self.config, self._gemma
        shape = AttentionShape(self._ropes[opts.kinds[index]], qk_norm="head" if cfg.model_type == GEMMA3 else None,
                               offset_norm=True)
        attn = FlexAttention(cfg, index if kv_layer is None else kv_layer, dtype, quant, attention, self.tp, shape)
        mlp = GatedMLP(cfg, dtype, quant, self.tp, opts.activation)
        return FlexLayer(cfg, attn, mlp, dtype, "sandwich", norm=OffsetRMSNorm)
