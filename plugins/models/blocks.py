"""The pieces the Gemma, Phi-3, SmolLM3, OLMo 2 and Granite decoders add to the kit's: an
attention block with its own RoPE (or none), partial rotary and q/k norms of either width, a gated
MLP of any activation, ``1 + w`` RMSNorm, and a decoder layer whose norms sit before, after or
around each block, with a residual multiplier.

``FlexDecoder`` is the kit's ``DecoderForCausalLM`` with an embedding multiplier, a final-logit
soft-cap and a logit divisor; a family subclass sets ``make_layer`` and its checkpoint names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmplug.api import AttentionBackend, KVLayerView, ModelConfig, QuantMethod, StepContext
from lmplug.kit.decoder import Attention, DecoderForCausalLM
from lmplug.kit.layers import RMSNorm, apply_rope, gelu_tanh_and_mul, silu_and_mul
from lmplug.kit.native_step import LayerForm
from lmplug.kit.parallel import ParallelState
from lmplug.kit.parallel_layers import column_linear, row_linear
from lmplug.kit.pipeline import stage_input, stage_output
from lmplug.kit.rope import RotaryEmbedding


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, ``x / rms(x) * (1 + w)``: checkpoints store ``w``; once loaded the weight
    holds ``1 + w``, so the kit's norm (and its fused CPU path) computes it."""

    def after_loading(self) -> None:
        self._parameters["weight"].data.add_(1.0)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul, "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_tanh": gelu_tanh_and_mul,
}
NATIVE_ACTIVATIONS = {silu_and_mul: "silu", gelu_tanh_and_mul: "gelu_tanh"}  # the native decode step's names


@dataclass(frozen=True)
class AttentionShape:
    """What differs in a layer's attention block: its RoPE (None: no position encoding, NoPE),
    the rotated width of a head (None: all of it), its q/k norms ("head": per head, "full": over
    all heads, None), and whether the checkpoint fuses q/k/v into one ``qkv_proj``."""

    rope: RotaryEmbedding | None
    rotary_dim: int | None = None
    qk_norm: str | None = None
    offset_norm: bool = False
    fused_qkv: bool = False


class FlexAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                 backend: AttentionBackend, tp: ParallelState, shape: AttentionShape) -> None:
        super().__init__(cfg, layer, dtype, quant, backend, tp)
        self.shape = shape
        self.rope = shape.rope
        self.sinks: torch.nn.Parameter | None = None  # GPT-OSS: a learned logit per head (the subclass's)
        if shape.fused_qkv:  # Phi-3: one qkv_proj tensor, kept fused (one process)
            self.qkv_proj = column_linear(cfg.hidden_size, {"qkv_proj": (0, self.q_size + 2 * self.kv_size)},
                                          bias=cfg.attention_bias, dtype=dtype, quant=quant, tp=tp)
        norm = OffsetRMSNorm if shape.offset_norm else RMSNorm
        if shape.qk_norm == "head":
            self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        elif shape.qk_norm == "full":  # OLMo 2: over every head at once
            self.q_norm = norm(self.q_size, cfg.rms_norm_eps, dtype)
            self.k_norm = norm(self.kv_size, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.shape.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.shape.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self._rotate(positions, q, k)
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        out = self.backend.forward(self.layer, q.contiguous(), k.contiguous(), v.contiguous(), kv, ctx, **extra)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        dim = self.shape.rotary_dim
        if dim is None or dim == self.head_dim:
            return apply_rope(self.rope, positions, q, k)  # fused path: in place, the projection is ours
        q_rot, k_rot = self.rope(positions, q[..., :dim], k[..., :dim])  # Phi-4-mini: the first dims only
        return torch.cat([q_rot, q[..., dim:]], -1), torch.cat([k_rot, k[..., dim:]], -1)


class GatedMLP(torch.nn.Module):
    """``down(act(gate(x)) * up(x))``; ``fused``: the checkpoint holds one ``gate_up_proj``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod, tp: ParallelState,
                 activation: str, fused: bool = False) -> None:
        super().__init__()
        start, self.intermediate = tp.split(cfg.intermediate_size)
        shards = ({"gate_up_proj": (0, 2 * self.intermediate)} if fused else
                  {"gate_proj": (start, self.intermediate), "up_proj": (start, self.intermediate)})
        self.gate_up_proj = column_linear(cfg.hidden_size, shards, bias=cfg.mlp_bias, dtype=dtype, quant=quant, tp=tp)
        self.down_proj = row_linear(cfg.intermediate_size, {"down_proj": cfg.hidden_size}, bias=cfg.mlp_bias,
                                    dtype=dtype, quant=quant, tp=tp)
        if activation not in ACTIVATIONS:
            from lmplug.errors import ModelLoadError

            raise ModelLoadError(f"config.json: hidden_act {activation!r} is not supported by this architecture; "
                                 f"supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class FlexLayer(torch.nn.Module):
    """A decoder layer whose norms are placed by ``style``:

    - "pre" (Llama, Granite): ``h = x + m * attn(n1(x))``, ``out = h + m * mlp(n2(h))``;
    - "sandwich" (Gemma 2/3): ``h = x + n2(attn(n1(x)))``, ``out = h + n4(mlp(n3(h)))``;
    - "post" (OLMo 2): ``h = x + n2(attn(x))``, ``out = h + n4(mlp(h))``;

    with ``m`` the residual multiplier (Granite; 1 elsewhere) and n1..n4 ``input_layernorm``,
    ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``."""

    def __init__(self, cfg: ModelConfig, attn: torch.nn.Module, mlp: torch.nn.Module, dtype: torch.dtype,
                 style: str, norm: type[RMSNorm] = RMSNorm, residual_multiplier: float = 1.0) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.style, self.multiplier = style, residual_multiplier
        if style != "post":
            self.input_layernorm = norm(size, eps, dtype)
        self.self_attn = attn
        self.post_attention_layernorm = norm(size, eps, dtype)
        if style == "sandwich":
            self.pre_feedforward_layernorm = norm(size, eps, dtype)
        if style != "pre":
            self.post_feedforward_layernorm = norm(size, eps, dtype)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        # the blocks' outputs are fresh tensors: sums and scales go in place, norms fuse with adds
        if self.style == "pre":
            a = self.self_attn(self.input_layernorm(x), positions, rope, kv, ctx)
            if self.multiplier != 1.0:
                a.mul_(self.multiplier)
            h, normed = self.post_attention_layernorm.add_forward(a, x)
            m = self.mlp(normed)
            return h.add_(m.mul_(self.multiplier) if self.multiplier != 1.0 else m)
        if self.style == "sandwich":
            a = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, rope, kv, ctx))
            h, normed = self.pre_feedforward_layernorm.add_forward(a, x)
            return h.add_(self.post_feedforward_layernorm(self.mlp(normed)))
        h = x + self.post_attention_layernorm(self.self_attn(x, positions, rope, kv, ctx))
        return h.add_(self.post_feedforward_layernorm(self.mlp(h)))

    def native_form(self, rope: RotaryEmbedding) -> LayerForm | None:
        """This layer as the kit's native decode step runs it; None for a subclass, another
        attention or MLP block (GPT-OSS: sinks, experts), or an activation it has no C form of."""
        attn, mlp = self.self_attn, self.mlp
        act = NATIVE_ACTIVATIONS.get(mlp.act) if type(mlp) is GatedMLP else None
        if type(self) is not FlexLayer or type(attn) is not FlexAttention or attn.sinks is not None or act is None:
            return None
        norms = tuple(getattr(self, name, None) for name in ("input_layernorm", "post_attention_layernorm",
                                                             "pre_feedforward_layernorm", "post_feedforward_layernorm"))
        return LayerForm(self.style, norms, attn, mlp, act, attn.shape.qk_norm, attn.rope, attn.shape.rotary_dim,
                         self.multiplier)


class FlexDecoder(DecoderForCausalLM):
    """The kit's causal LM with ``embedding_multiplier`` (x it after the embedding; Gemma: sqrt
    of hidden), ``final_softcap`` (logits soft-capped, Gemma 2) and ``logits_divisor`` (Granite)."""

    embedding_multiplier: float = 1.0
    final_softcap: float | None = None
    logits_divisor: float = 1.0

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod, attention: AttentionBackend,
                 max_model_len: int, *, parallel: ParallelState | None = None) -> None:
        # the kit builds the layers before its ``self.rope``: ``layer_rope`` builds it for them first
        self._rope_args = (max(max_model_len, cfg.max_position_embeddings), dtype, [])
        super().__init__(cfg, dtype, quant, attention, max_model_len, parallel=parallel)
        if self._rope_args[2]:
            self.rope = self._rope_args[2][0]

    def layer_rope(self) -> RotaryEmbedding:
        """The model's RoPE (config.json's theta and scaling), one object all layers share."""
        max_position, dtype, built = self._rope_args
        if not built:
            cfg = self.config
            built.append(RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype))
        return built[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        x = stage_input(self.tp, self.embed, input_ids, self.config.hidden_size, self.hidden_dtype)  # [T, h]
        # the layers in one C call where they can; None: a pipeline stage before the last
        return stage_output(self.tp, self.run_layers(x, positions, ctx), self.norm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if logits is None:  # a tensor-parallel rank other than 0
            return None
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


SLIDING, FULL = "sliding_attention", "full_attention"


def layer_kinds(cfg: ModelConfig, default: Callable[[int], str]) -> tuple[str, ...]:
    """Each layer's attention kind from config.json ``layer_types`` ("sliding_attention" /
    "full_attention"), else ``default(layer)``; a bad list is a ``ModelLoadError``."""
    raw = cfg.raw.get("layer_types")
    if raw is None:
        return tuple(default(i) for i in range(cfg.num_layers))
    if not isinstance(raw, list) or len(raw) != cfg.num_layers or any(k not in (SLIDING, FULL) for k in raw):
        from lmplug.errors import ModelLoadError

        raise ModelLoadError(f"config.json: 'layer_types' must list {cfg.num_layers} entries (num_hidden_layers), "
                             f"each {SLIDING!r} or {FULL!r}; got {str(raw)[:200]}")
    return tuple(raw)


def rope_of(head_dim: int, max_position: int, params: dict, dtype: torch.dtype) -> RotaryEmbedding:
    """A ``RotaryEmbedding`` from one ``rope_parameters`` entry (theta, optional scaling)."""
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return RotaryEmbedding(head_dim, max_position, float(params.get("rope_theta", 10000.0)), scaling, dtype)
