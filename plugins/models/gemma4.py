"""Gemma 4 text (``gemma4_text``): sliding layers of ``head_dim`` and full layers of their own
head size and KV heads (``per_layer_config``, or ``global_head_dim`` / ``num_global_key_value_heads``),
full layers' K used as V (``attention_k_eq_v``), q/k norms and a scale-free v-norm, attention
scale 1.0, "proportional" partial RoPE on full layers, sandwich norms with a plain ``w`` RMSNorm,
a per-layer ``layer_scalar``, sqrt(hidden) embedding scale, a final-logit soft-cap, and in MoE
layers a dense GeGLU MLP and GeGLU experts run side by side and summed.

Per-layer embeddings (``hidden_size_per_layer_input``), KV-sharing layers (``num_kv_shared_layers``)
and bidirectional attention are refused at load, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from lmplug_models.blocks import FULL, SLIDING, FlexDecoder, GatedMLP, rope_of

from lmplug.api import ConfigReader, LayerAttention, ModelConfig
from lmplug.kit.layers import RMSNorm, apply_rope
from lmplug.kit.parallel_layers import column_linear, row_linear

GEMMA4 = "gemma4_text"
_DEFAULT_ROPES = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                  FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


@dataclass(frozen=True)
class Gemma4Options:
    kinds: tuple[str, ...]  # per layer: SLIDING or FULL
    shapes: tuple[tuple[int, int], ...]  # per layer: (num_kv_heads, head_dim)
    k_eq_v: tuple[bool, ...]  # per layer: V is K (full layers with attention_k_eq_v)
    window: int
    ropes: dict  # kind -> rope_parameters
    final_softcap: float | None
    activation: str
    experts: tuple[int, int, int] | None  # (num_experts, top_k, moe_intermediate_size) or None


def gemma4_options(cfg: ModelConfig, where: str = "config.json") -> Gemma4Options:
    """The Gemma 4 facts of ``cfg.raw``, each checked (``ModelLoadError`` naming ``where`` and the key)."""
    raw = cfg.raw
    r = ConfigReader(raw, where)
    n = cfg.num_layers
    for key, what in (("hidden_size_per_layer_input", "per-layer embeddings"),
                      ("num_kv_shared_layers", "layers sharing another layer's K/V")):
        if r.int(key, 0, low=0):
            r.fail(key, f"is {raw[key]}: {what} are not supported by the gemma4 architecture; 0 is")
    if raw.get("use_bidirectional_attention") is not None:
        r.fail("use_bidirectional_attention", f"is {raw['use_bidirectional_attention']!r}; the causal "
                                              "gemma4_text architecture serves null only")
    types = raw.get("layer_types")
    if types is None:
        kinds = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    elif not isinstance(types, list) or len(types) != n or any(k not in (SLIDING, FULL) for k in types):
        r.fail("layer_types", f"must list {n} entries (num_hidden_layers), each {SLIDING!r} or {FULL!r}")
    else:
        kinds = list(types)
    kinds[-1] = FULL  # transformers forces the last layer to full attention
    head_dim = r.int("head_dim", 256)
    k_eq_v = r.flag("attention_k_eq_v", False)
    overrides = _per_layer(r, raw, kinds, k_eq_v)
    shapes = tuple((overrides.get(i, {}).get("num_key_value_heads", cfg.num_kv_heads),
                    overrides.get(i, {}).get("head_dim", head_dim)) for i in range(n))
    for heads, _ in shapes:
        if cfg.num_heads % heads:
            r.fail("num_key_value_heads", f"{heads} KV heads do not divide {cfg.num_heads} attention heads")
    ropes = r.mapping("rope_parameters") or _DEFAULT_ROPES
    for kind in set(kinds):
        if not isinstance(ropes.get(kind), dict):
            r.fail("rope_parameters", f"needs an entry for {kind!r}")
    activation = r.text("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        r.fail("hidden_activation", f"is {activation!r}; the gemma4 architecture runs gelu_pytorch_tanh")
    experts = None
    if r.flag("enable_moe_block", False):
        experts = (r.int("num_experts"), r.int("top_k_experts"), r.int("moe_intermediate_size"))
        if experts[1] > experts[0]:
            r.fail("top_k_experts", f"is {experts[1]}, more than num_experts ({experts[0]})")
    return Gemma4Options(kinds=tuple(kinds), shapes=shapes,
                         k_eq_v=tuple(k_eq_v and kind == FULL for kind in kinds),
                         window=r.int("sliding_window", 512), ropes=ropes,
                         final_softcap=r.number("final_logit_softcapping", None), activation=activation,
                         experts=experts)


def _per_layer(r: ConfigReader, raw: dict, kinds: list[str], k_eq_v: bool) -> dict[int, dict[str, int]]:
    """Each layer's overrides of head_dim / num_key_value_heads: ``per_layer_config`` (what
    transformers saves) or, as transformers derives it, ``global_head_dim`` (default 512) for the
    full layers with ``num_global_key_value_heads`` where ``attention_k_eq_v``."""
    saved = raw.get("per_layer_config")
    if saved is None:
        full = {"head_dim": r.int("global_head_dim", 512)}
        if k_eq_v and raw.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = r.int("num_global_key_value_heads")
        return {i: full for i, kind in enumerate(kinds) if kind == FULL}
    if not isinstance(saved, dict):
        r.fail("per_layer_config", "must map layer indices to {head_dim, num_key_value_heads}")
    out = {}
    for key, fields in saved.items():
        if not str(key).isdigit() or int(key) >= len(kinds) or not isinstance(fields, dict):
            r.fail("per_layer_config", f"entry {key!r} is not a layer index below {len(kinds)} with a mapping")
        unknown = set(fields) - {"head_dim", "num_key_value_heads"}
        if unknown or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in fields.values()):
            r.fail("per_layer_config", f"layer {key}: expected positive head_dim / num_key_value_heads, "
                                       f"got {fields}")
        out[int(key)] = fields
    return out


def gemma4_layers(opts: Gemma4Options) -> tuple[LayerAttention, ...]:
    """How each layer attends: scale 1.0 (q/k are normed), the window of sliding layers."""
    return tuple(LayerAttention(1.0, opts.window if kind == SLIDING else None, None) for kind in opts.kinds)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's v-norm and router norm), in float32 as transformers."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class Gemma4Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kv_heads: int, head_dim: int, k_eq_v: bool,
                 rope, dtype: torch.dtype, quant, backend, tp) -> None:
        super().__init__()
        self.layer, self.backend, self.rope, self.eps = layer, backend, rope, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim, self.k_eq_v = cfg.num_heads, kv_heads, head_dim, k_eq_v
        self.q_size, self.kv_size = cfg.num_heads * head_dim, kv_heads * head_dim
        shards = {"q_proj": (0, self.q_size), "k_proj": (0, self.kv_size)}
        if not k_eq_v:
            shards["v_proj"] = (0, self.kv_size)
        self.qkv_proj = column_linear(cfg.hidden_size, shards, bias=cfg.attention_bias, dtype=dtype, quant=quant, tp=tp)
        self.o_proj = row_linear(self.q_size, {"o_proj": cfg.hidden_size}, bias=cfg.attention_bias, dtype=dtype,
                                 quant=quant, tp=tp)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, H, D], k and v [T, Hkv, D]: normed, q and k rotated."""
        parts = self.qkv_proj(x).split([self.q_size] + [self.kv_size] * (1 if self.k_eq_v else 2), dim=-1)
        q = parts[0].reshape(-1, self.num_heads, self.head_dim)
        k = parts[1].reshape(-1, self.num_kv_heads, self.head_dim)
        v = k if self.k_eq_v else parts[2].reshape(-1, self.num_kv_heads, self.head_dim)
        v = _unit_rms(v, self.eps)
        q, k = apply_rope(self.rope, positions, self.q_norm(q), self.k_norm(k))
        return q.contiguous(), k.contiguous(), v.contiguous()

    def forward(self, x, positions, kv, ctx) -> torch.Tensor:
        out = self.backend.forward(self.layer, *self.project(x, positions), kv, ctx)
        return self.o_proj(out.reshape(-1, self.q_size))


class Gemma4Router(torch.nn.Module):
    """Softmax over the experts of the unit-normed, scaled input; top-k renormalised, then each
    weight times its expert's ``per_expert_scale``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.scale = torch.nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.per_expert_scale = torch.nn.Parameter(torch.ones(num_experts, dtype=dtype), requires_grad=False)
        self.top_k, self.eps, self.root = top_k, eps, hidden ** -0.5
        self.proj.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.proj(_unit_rms(x, self.eps) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.per_expert_scale[ids]


class Gemma4Experts(torch.nn.Module):
    """GeGLU experts stacked as the checkpoint holds them: gate_up_proj [E, 2I, h] (gate rows
    first), down_proj [E, h, I]; each token's top-k outputs weighted and summed."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype),
                                               requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype),
                                            requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            out.index_add_(0, token, (h * weights[token, slot, None]).to(x.dtype))
        return out


class Gemma4Layer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, attn: Gemma4Attention, mlp: GatedMLP, experts: tuple | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.layer_scalar = torch.nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        self.router = self.experts = None
        if experts is not None:
            num, top_k, inter = experts
            self.router = Gemma4Router(cfg.hidden_size, num, top_k, cfg.rms_norm_eps, dtype)
            self.experts = Gemma4Experts(num, cfg.hidden_size, inter, dtype)
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            self.pre_feedforward_layernorm_2 = norm()

    def forward(self, x, positions, rope, kv, ctx) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, kv, ctx))
        return self.feed_forward(h) * self.layer_scalar

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """h + the feed-forward block's output (before ``layer_scalar``)."""
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.experts is not None:  # the dense MLP and the experts side by side, both from h
            ids, weights = self.router(h)
            moe = self.experts(self.pre_feedforward_layernorm_2(h), ids, weights)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        return h + self.post_feedforward_layernorm(out)


class Gemma4ForCausalLM(FlexDecoder):
    """Gemma 4 text (``model_type`` gemma4_text), dense or MoE."""

    layer_class: ClassVar[type[Gemma4Layer]] = Gemma4Layer
    pipeline_stages = False  # layers may read another layer's cache (KV sharing)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant, attention, max_model_len: int, *,
                 parallel=None) -> None:
        opts = gemma4_options(cfg)
        max_position = max(max_model_len, cfg.max_position_embeddings)
        self._gemma4 = opts
        self._ropes = {}
        for kind, shape in zip(opts.kinds, opts.shapes):
            self._ropes.setdefault((kind, shape[1]), rope_of(shape[1], max_position, opts.ropes[kind], dtype))
        super().__init__(cfg, dtype, quant, attention, max_model_len, parallel=parallel)
        self.embedding_multiplier = cfg.hidden_size ** 0.5
        self.final_softcap = opts.final_softcap

    def layer_rope(self):
        return next(iter(self._ropes.values()))

    def new_layer(self, index, dtype, quant, attention, kv_layer=None):
        cfg, opts = self.config, self._gemma4
        heads, dim = opts.shapes[index]
        attn = Gemma4Attention(cfg, index if kv_layer is None else kv_layer, heads, dim, opts.k_eq_v[index],
                               self._ropes[(opts.kinds[index], dim)], dtype, quant, attention, self.tp)
        mlp = GatedMLP(cfg, dtype, quant, self.tp, opts.activation)
        return self.layer_class(cfg, attn, mlp, opts.experts, dtype)
