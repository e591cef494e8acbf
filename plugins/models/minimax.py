"""MiniMax-Text-01 (``MiniMaxForCausalLM``): lightning attention interleaved with softmax attention.

``config.layer_types`` says which layers are softmax attention (the Llama family's, GQA + RoPE, K/V
in the cache) and which lightning attention (``"linear_attention"``); every layer's feed-forward is
Mixtral's sparse MoE (``block_sparse_moe``, softmax top-k renormalised). As transformers'
``MiniMaxDecoderLayer`` computes it, the residual is taken *after* each norm, and both branches are
scaled by the config's alpha (residual) and beta (branch) factors:

    h = RMSNorm_in(x);    h = alpha_attn h + beta_attn mixer(h)     (full_attn_* or linear_attn_*)
    h = RMSNorm_post(h);  out = alpha_mlp h + beta_mlp MoE(h)       (mlp_alpha_factor, mlp_beta_factor)

A lightning layer (transformers' ``MiniMaxLightningAttention``; Qin et al. 2024, "Lightning
Attention-2"), H heads of width D, no scale, no softmax, no positions:

    q, k, v = split_per_head(silu(qkv_proj(h)))           [T, H, 3D] -> three [T, H, D]
    S_t = exp(-slope_h) S_{t-1} + k_t^T v_t,  o_t = q_t S_t   state [H, D, D] fp32 per sequence
    out = out_proj(sigmoid(output_gate(h)) * RMSNorm(o))  RMSNorm over H D, eps 1e-6

with ``slope_h = (2^(-8/H))^(h+1) * (1 - layer / (L - 1 + 1e-5) + 1e-5)`` from the model layer index
(``lightning_slopes``). The scan runs through the mixer backend, decode rows and prefill chunks
apart (``state_layers``). The checkpoint's precomputed decay buffers (``slope_rate``,
``query_decay``, ``key_decay``, ``diagonal_decay``) are derived from the config and not read.

Tensor parallelism (N ranks): a lightning layer's heads are split (rank r: heads
``[r H/N, (r+1) H/N)``, their rows of qkv_proj, per head q|k|v, and of output_gate, their slopes and
their [H/N, D, D] state), out_proj by rows (one all-reduce). The output RMSNorm spans all H D
channels: each rank holds its heads' part of the weight and the sums of squares are all-reduced
(``SplitRMSNorm``). Softmax layers and experts split as in the Llama / MoE decoders.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lmplug_models.hybrid import HybridForCausalLM

from lmplug.api import (
    ATTENTION,
    AttentionBackend,
    ConfigReader,
    MixerBackend,
    ModelConfig,
    MoEBackend,
    QuantMethod,
    StateTensor,
    StepContext,
)
from lmplug.errors import ModelLoadError
from lmplug.kit.decoder import Attention
from lmplug.kit.layers import RMSNorm
from lmplug.kit.parallel import ParallelState
from lmplug.kit.parallel_layers import column_linear, row_linear
from lmplug.kit.rope import RotaryEmbedding
from lmplug.kit.sharding import RangeShard
from lmplug.kit.state_layers import StateRows, run_split

# transformers' MiniMaxLightningAttention builds its output norm with MiniMaxRMSNorm's default eps
OUTPUT_NORM_EPS = 1e-6
# checkpoint buffers transformers derives from the config (and saves); recomputed here, never read
_DERIVED_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
_LIGHTNING_LINEARS = ("qkv_proj", "out_proj", "output_gate")


def lightning_slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates ``slope [H]`` (fp32) of model layer ``layer`` of ``num_layers``: ALiBi's
    geometric slopes ``(2^(-8/H))^(h+1)``, scaled down linearly with depth (transformers'
    ``MiniMaxLightningAttention.get_slope_rate``)."""
    base = 2.0 ** (-8.0 / num_heads)
    exponent = torch.arange(1, num_heads + 1, dtype=torch.float64)
    factor = 1.0 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** exponent * factor).to(torch.float32)


class ResidualFactors:
    """The alpha (residual) and beta (branch) factors of a MiniMax config (default 1)."""

    def __init__(self, cfg: ModelConfig) -> None:
        r = ConfigReader(cfg.raw, "config.json")

        def pair(prefix: str) -> tuple[float, float]:
            return (r.number(f"{prefix}_alpha_factor", 1.0, positive=False),
                    r.number(f"{prefix}_beta_factor", 1.0, positive=False))

        self.full_attn, self.linear_attn, self.mlp = pair("full_attn"), pair("linear_attn"), pair("mlp")


class SplitRMSNorm(torch.nn.Module, RangeShard):
    """RMSNorm over ``full`` channels of which this rank holds ``[start, start + size)`` (its
    heads): the sum of squares is all-reduced, then each rank scales its own channels (fp32)."""

    def __init__(self, full: int, start: int, size: int, eps: float, dtype: torch.dtype,
                 tp: ParallelState) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.full, self.eps, self.tp = full, eps, tp
        self.tp_ranges = {"weight": ((start, size),)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sums = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))  # [T, 1]: over every rank's channels
        return self.weight * (xf * torch.rsqrt(sums / self.full + self.eps)).to(x.dtype)


class LightningAttention(torch.nn.Module):
    """``mixer(h [T, hidden], positions, rope, pools, ctx) -> [T, hidden]``; its state lives in
    ``pools["lightning"]`` [num_slots, H, D, D] fp32 (this rank's heads under tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                 mixer: MixerBackend, tp: ParallelState) -> None:
        super().__init__()
        head0, self.num_heads = tp.split(cfg.num_heads)
        self.head_dim, self.ops = cfg.head_dim, mixer
        d, inner = cfg.head_dim, self.num_heads * cfg.head_dim
        self.qkv_proj = column_linear(cfg.hidden_size, {"qkv_proj": (3 * d * head0, 3 * inner)}, bias=False,
                                      dtype=dtype, quant=quant, tp=tp)
        self.output_gate = column_linear(cfg.hidden_size, {"output_gate": (d * head0, inner)}, bias=False,
                                         dtype=dtype, quant=quant, tp=tp)
        full = cfg.num_heads * d
        self.out_proj = row_linear(full, {"out_proj": cfg.hidden_size}, bias=False, dtype=dtype, quant=quant,
                                   tp=tp)
        self.norm = (SplitRMSNorm(full, d * head0, inner, OUTPUT_NORM_EPS, dtype, tp) if tp.is_parallel
                     else RMSNorm(inner, OUTPUT_NORM_EPS, dtype))
        slope = lightning_slopes(cfg.num_heads, layer, cfg.num_layers)[head0:head0 + self.num_heads]
        self.register_buffer("slope", slope.contiguous(), persistent=False)

    def state_tensors(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        return (StateTensor("lightning", (self.num_heads, self.head_dim, self.head_dim), torch.float32),)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                pools: dict[str, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        rows = StateRows.of(ctx)
        qkv = F.silu(self.qkv_proj(h)).view(-1, self.num_heads, 3 * self.head_dim)  # [T, H, 3D], per head q|k|v
        q, k, v = (t.contiguous() for t in qkv.split(self.head_dim, dim=-1))  # [T, H, D] each
        state, slope, ops = pools["lightning"], self.slope, self.ops
        o = run_split(
            rows,
            lambda s: ops.lightning_update(q[s], k[s], v[s], slope, state, rows.decode_slots),
            lambda s: ops.lightning_scan(q[s], k[s], v[s], slope, rows.prefill_cu, state, rows.prefill_slots))
        o = self.norm(o.reshape(-1, self.num_heads * self.head_dim))  # [T, H D]
        return self.out_proj(torch.sigmoid(self.output_gate(h)) * o)


class MiniMaxDecoderLayer(torch.nn.Module):
    """Norm, mixer (softmax or lightning attention), norm, MoE; residuals taken after the norms,
    scaled by ``attn`` and ``mlp`` (alpha, beta)."""

    def __init__(self, cfg: ModelConfig, mixer: torch.nn.Module, mlp: torch.nn.Module, dtype: torch.dtype,
                 attn: tuple[float, float], mlp_factors: tuple[float, float]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp
        self.attn_alpha, self.attn_beta = attn
        self.mlp_alpha, self.mlp_beta = mlp_factors

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, cache,
                ctx: StepContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = h * self.attn_alpha + self.self_attn(h, positions, rope, cache, ctx) * self.attn_beta
        h = self.post_attention_layernorm(h)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta


class MiniMaxForCausalLM(HybridForCausalLM):
    """``forward(input_ids [T], positions [T], ctx) -> hidden [T, h]``: K/V of the softmax layers in
    the KV cache (``bind_kv``), lightning states in its state pool (``bind_states``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod, attention: AttentionBackend,
                 max_model_len: int, *, moe: MoEBackend, parallel: ParallelState | None = None,
                 mixer: MixerBackend | None = None) -> None:
        if cfg.hidden_act not in ("silu", "swish"):
            raise ModelLoadError(f"config.json: 'hidden_act' is {cfg.hidden_act!r}; MiniMax's lightning "
                                 "attention and experts use silu")
        self.factors = ResidualFactors(cfg)  # read while the base class builds the layers
        super().__init__(cfg, dtype, quant, attention, max_model_len, moe=moe, parallel=parallel, mixer=mixer)

    def new_layer(self, index: int, dtype: torch.dtype, quant: QuantMethod, attention: AttentionBackend,
                  kv_layer: int | None = None) -> torch.nn.Module:
        cfg = self.config
        if cfg.layer_types[index] == ATTENTION:
            kv_layer = self.cache_index[index] if kv_layer is None else kv_layer
            mixer, factors = Attention(cfg, kv_layer, dtype, quant, attention, self.tp), self.factors.full_attn
        else:
            mixer = self.make_state_mixer(cfg, index, self.cache_index[index], dtype, quant)
            factors = self.factors.linear_attn
        mlp = self.make_mlp(cfg, index, dtype, quant)
        if mlp is None:
            raise ModelLoadError(f"model_type {cfg.model_type!r}: layer {index} has no MoE block")
        return MiniMaxDecoderLayer(cfg, mixer, mlp, dtype, factors, self.factors.mlp)

    def make_state_mixer(self, cfg: ModelConfig, layer: int, state_index: int, dtype: torch.dtype,
                         quant: QuantMethod) -> torch.nn.Module:
        return LightningAttention(cfg, layer, dtype, quant, self.mixer_backend, self.tp)

    def weight_target(self, name: str) -> tuple[str, str | None] | tuple[str, str | None, int] | None:
        """As the MoE decoder's, plus the lightning layers' projections (one shard each, named as
        the module) and the skipped decay buffers."""
        if name.startswith("model.layers."):
            idx, _, tail = name[len("model.layers."):].partition(".")
            module, _, param = tail.rpartition(".")
            if module == "self_attn" and param in _DERIVED_BUFFERS:
                return None
            if module.startswith("self_attn.") and module[len("self_attn."):] in _LIGHTNING_LINEARS:
                return f"layers.{idx}.{tail}", module[len("self_attn."):]
        return super().weight_target(name)
