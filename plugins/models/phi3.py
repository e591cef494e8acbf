"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder with fused ``qkv_proj`` and ``gate_up_proj``
checkpoint tensors (kept fused: one product each), LongRoPE and partial rotary (Phi-4-mini).

LongRoPE: per rotary pair a short and a long rescaling factor, and cos/sin scaled by
``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``. transformers switches to the long
factors for a forward whose sequence exceeds ``original_max_position_embeddings``; an engine that
caches keys cannot re-rotate them mid-sequence, so lmplug decides once per engine, as llama.cpp
does: the long factors when ``max_model_len`` exceeds the original context, else the short ones
(the same as transformers for every sequence on that side of the original length).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from lmplug_models.blocks import AttentionShape, FlexAttention, FlexDecoder, FlexLayer, GatedMLP

from lmplug.api import ConfigReader, ModelConfig
from lmplug.errors import ModelLoadError
from lmplug.kit.decoder import MLP, Attention, DecoderForCausalLM, DecoderLayer
from lmplug.kit.parallel_layers import column_linear
from lmplug.kit.rope import RotaryEmbedding


def rotary_dim(cfg: ModelConfig, where: str = "config.json") -> int:
    """The rotated width of a head: ``partial_rotary_factor`` of it (Phi-4-mini: 0.75)."""
    params = cfg.raw.get("rope_parameters") if isinstance(cfg.raw.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", cfg.raw.get("partial_rotary_factor", 1.0))
    factor = ConfigReader({"partial_rotary_factor": factor}, where).number("partial_rotary_factor")
    dim = int(cfg.head_dim * factor)
    if dim % 2 or not 0 < dim <= cfg.head_dim:
        raise ModelLoadError(f"{where}: 'partial_rotary_factor' {factor} gives a rotary width of {dim} of "
                             f"head_dim {cfg.head_dim}; expected an even width in (0, head_dim]")
    return dim


def check_longrope(cfg: ModelConfig, where: str = "config.json") -> None:
    """LongRoPE's factors: one per rotary pair each, numbers (``ModelLoadError`` naming the key)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    half = rotary_dim(cfg, where) // 2
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if (not isinstance(values, list) or len(values) != half
                or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in values)):
            raise ModelLoadError(f"{where}: rope_scaling {key!r} must be a list of {half} positive numbers "
                                 "(one per rotary pair)")
    original = scaling.get("original_max_position_embeddings", cfg.raw.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 2:
        raise ModelLoadError(f"{where}: 'original_max_position_embeddings' must be an integer >= 2 for LongRoPE, "
                             f"got {original!r}")


class LongRoPE(RotaryEmbedding):
    """cos/sin of LongRoPE with one set of factors (``long``: the long ones) for every position."""

    def __init__(self, dim: int, max_position: int, theta: float, scaling: dict, model_max: int,
                 long: bool, dtype: torch.dtype) -> None:
        torch.nn.Module.__init__(self)
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or model_max / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        inv_freq = 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * attention).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention).to(dtype), persistent=False)


def phi3_rope(cfg: ModelConfig, max_model_len: int, dtype: torch.dtype) -> RotaryEmbedding:
    dim, scaling = rotary_dim(cfg), cfg.rope_scaling
    max_position = max(max_model_len, cfg.max_position_embeddings)
    if scaling is None or scaling.get("rope_type") != "longrope":
        return RotaryEmbedding(dim, max_position, cfg.rope_theta, scaling, dtype)
    scaling = {"original_max_position_embeddings": cfg.raw.get("original_max_position_embeddings"), **scaling}
    long = max_model_len > int(scaling["original_max_position_embeddings"])
    return LongRoPE(dim, max_position, cfg.rope_theta, scaling, cfg.max_position_embeddings, long, dtype)


class Phi3ForCausalLM(FlexDecoder):
    STACKED: ClassVar[dict[str, tuple[str, str]]] = {
        **DecoderForCausalLM.STACKED,
        "self_attn.qkv_proj": ("self_attn.qkv_proj", "qkv_proj"),
        "mlp.gate_up_proj": ("mlp.gate_up_proj", "gate_up_proj"),
    }

    def __init__(self, cfg, dtype, quant, attention, max_model_len, *, parallel=None) -> None:
        # the kit's RotaryEmbedding knows no LongRoPE: build it over a config without the scaling
        import dataclasses

        self.__dict__["_phi_rope"] = phi3_rope(cfg, max_model_len, dtype)  # a module, before Module.__init__
        self._rotary_dim = rotary_dim(cfg)
        super().__init__(dataclasses.replace(cfg, rope_scaling=None), dtype, quant, attention, max_model_len,
                         parallel=parallel)
        self.rope = self._phi_rope

    # no multipliers: the kit's forward, whose native decode step takes the kit's layers
    forward = DecoderForCausalLM.forward

    def new_layer(self, index, dtype, quant, attention, kv_layer=None):
        cfg, layer = self.config, index if kv_layer is None else kv_layer
        if self._rotary_dim == cfg.head_dim and cfg.hidden_act in ("silu", "swish"):
            # the kit's layer with the fused tensors as one shard each (the native decode step runs it)
            attn = Attention(cfg, layer, dtype, quant, attention, self.tp)
            attn.qkv_proj = column_linear(cfg.hidden_size, {"qkv_proj": (0, attn.q_size + 2 * attn.kv_size)},
                                          bias=cfg.attention_bias, dtype=dtype, quant=quant, tp=self.tp)
            mlp = MLP(cfg, dtype, quant, tp=self.tp)
            mlp.gate_up_proj = column_linear(cfg.hidden_size, {"gate_up_proj": (0, 2 * mlp.intermediate)},
                                             bias=cfg.mlp_bias, dtype=dtype, quant=quant, tp=self.tp)
            return DecoderLayer(cfg, layer, dtype, quant, attention, mlp=mlp, attn=attn, tp=self.tp)
        shape = AttentionShape(self.__dict__["_phi_rope"], rotary_dim=self._rotary_dim, fused_qkv=True)
        attn = FlexAttention(cfg, layer, dtype, quant, attention, self.tp, shape)
        return FlexLayer(cfg, attn, GatedMLP(cfg, dtype, quant, self.tp, cfg.hidden_act, fused=True), dtype, "pre")
