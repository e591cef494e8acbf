"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet layers interleaved with gated softmax attention.

``layer_types`` says which layers are gated DeltaNet (``gated_deltanet.GatedDeltaNet``, a state
layer) and which softmax attention (``GatedAttention``); the feed-forward blocks are Qwen2-MoE's
(routed experts plus a sigmoid-gated shared expert; ``mlp_only_layers`` / ``decoder_sparse_step``
give dense layers). Where Qwen3-Next differs from the Llama / Qwen3 family (transformers'
``modeling_qwen3_next.py``):

- every RMSNorm of the decoder (input, post-attention, final, per-head q/k) is zero-centred: the
  checkpoint stores ``w`` and the norm scales by ``1 + w`` (``ZeroCentredRMSNorm``);
- attention: ``q_proj`` gives per head ``[query (D), gate (D)]``; after attention the output is
  multiplied by ``sigmoid(gate)`` before ``o_proj``;
- partial rotary: RoPE turns the first ``rotary_dim = head_dim * partial_rotary_factor`` dims of
  each q/k head (frequencies over ``rotary_dim``), the rest pass through.

The multi-token-prediction weights (``mtp.*``) are not the target model's and are skipped.

Tensor parallelism: the attention's query heads are split (``q_proj``'s rows of a head are its
[query | gate] pair, so a rank's are one range), its KV heads as in the Llama family, ``o_proj``
by rows; the DeltaNet layers split their key heads (``gated_deltanet``); experts as in the MoE
decoder.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from lmplug_models.gated_deltanet import GatedDeltaFacts, GatedDeltaNet
from lmplug_models.hybrid import HybridForCausalLM

from lmplug.api import (
    ATTENTION,
    AttentionBackend,
    ConfigReader,
    KVLayerView,
    MixerBackend,
    ModelConfig,
    MoEBackend,
    QuantMethod,
    StepContext,
)
from lmplug.errors import ModelLoadError
from lmplug.kit.layers import RMSNorm
from lmplug.kit.parallel import ParallelState, single
from lmplug.kit.parallel_layers import column_linear, row_linear
from lmplug.kit.rope import RotaryEmbedding


class ZeroCentredRMSNorm(RMSNorm):
    """transformers' ``Qwen3NextRMSNorm``: ``RMSNorm(x) * (1 + w)`` in fp32, cast back after the
    weight; ``w`` (the checkpoint's) is the offset from 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reference(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        return total, self.reference(total)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).to(x.dtype)


def rotary_dim(cfg: ModelConfig) -> int:
    """``head_dim * partial_rotary_factor`` (transformers 5 keeps the factor in ``rope_parameters``)."""
    params = cfg.raw.get("rope_parameters")
    source = params if isinstance(params, dict) and "partial_rotary_factor" in params else cfg.raw
    factor = ConfigReader(source, "config.json").number("partial_rotary_factor", 1.0)
    dim = int(cfg.head_dim * factor)
    if not 0 < dim <= cfg.head_dim or dim % 2:
        raise ModelLoadError(f"config.json: partial_rotary_factor {factor} gives {dim} rotary dims of "
                             f"head_dim {cfg.head_dim}; it must be an even number in (0, head_dim]")
    return dim


class GatedAttention(torch.nn.Module):
    """Qwen3-Next's softmax attention: q/k zero-centred RMSNorm per head, partial RoPE, the output
    gated by ``sigmoid(gate)`` from ``q_proj``'s second half of each head."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                 backend: AttentionBackend, tp: ParallelState | None = None) -> None:
        super().__init__()
        tp = tp or single()  # tensor parallel: this rank's query heads and KV heads
        self.layer, self.backend = layer, backend
        first_kv, self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)
        self.num_heads, self.head_dim = cfg.num_heads // tp.world_size, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        kv_size, kv_start = self.num_kv_heads * cfg.head_dim, first_kv * cfg.head_dim
        self.qkv_proj = column_linear(cfg.hidden_size, {"q_proj": (2 * self.q_size * tp.rank, 2 * self.q_size),
                                                        "k_proj": (kv_start, kv_size), "v_proj": (kv_start, kv_size)},
                                      bias=cfg.attention_bias, dtype=dtype, quant=quant, tp=tp)
        self.o_proj = row_linear(cfg.num_heads * cfg.head_dim, {"o_proj": cfg.hidden_size}, bias=cfg.attention_bias,
                                 dtype=dtype, quant=quant, tp=tp)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = qg.reshape(n, self.num_heads, 2 * d).split([d, d], dim=-1)  # per head [query, gate]
        q = _partial_rope(rope, positions, self.q_norm(q))  # [T, H, D]
        k = _partial_rope(rope, positions, self.k_norm(k.reshape(n, self.num_kv_heads, d)))
        v = v.reshape(n, self.num_kv_heads, d).contiguous()
        out = self.backend.forward(self.layer, q, k, v, kv, ctx)  # [T, H, D]
        out = out.reshape(n, self.q_size) * torch.sigmoid(gate.reshape(n, self.q_size))
        return self.o_proj(out)


def _partial_rope(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rope``-width dims of x [T, N, D]; the rest as is."""
    dim = rope.cos.shape[-1]
    if dim == x.shape[-1]:
        return rope.rotate(positions, x)
    return torch.cat([rope.rotate(positions, x[..., :dim]), x[..., dim:]], dim=-1)


class Qwen3NextForCausalLM(HybridForCausalLM):
    """``forward(input_ids [T], positions [T], ctx) -> hidden [T, h]``; K/V of the attention
    layers and the DeltaNet states come from the KV cache (``bind_kv``, ``bind_states``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod,
                 attention: AttentionBackend, max_model_len: int, *, moe: MoEBackend,
                 parallel: ParallelState | None = None, mixer: MixerBackend | None = None) -> None:
        # read by make_state_mixer while the layers are built
        self.delta_facts = GatedDeltaFacts(cfg, 1 if parallel is None else parallel.world_size)
        super().__init__(cfg, dtype, quant, attention, max_model_len, moe=moe, parallel=parallel, mixer=mixer)
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rope = RotaryEmbedding(rotary_dim(cfg), max(max_model_len, cfg.max_position_embeddings),
                                    cfg.rope_theta, cfg.rope_scaling, dtype)

    def new_layer(self, index: int, dtype: torch.dtype, quant: QuantMethod, attention: AttentionBackend,
                  kv_layer: int | None = None) -> torch.nn.Module:
        layer = super().new_layer(index, dtype, quant, attention, kv_layer)
        cfg = self.config
        layer.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        layer.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        return layer

    def make_attention(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                       backend: AttentionBackend) -> torch.nn.Module:
        return GatedAttention(cfg, layer, dtype, quant, backend, self.tp)

    def make_state_mixer(self, cfg: ModelConfig, layer: int, state_index: int, dtype: torch.dtype,
                         quant: QuantMethod) -> torch.nn.Module:
        return GatedDeltaNet(cfg, self.delta_facts, state_index, dtype, quant, self.mixer_backend, self.tp)

    # -- checkpoint names: ``linear_attn.*`` is the mixer in ``self_attn`` -------------------------
    _DELTA_LINEARS: ClassVar[dict[str, str]] = {"in_proj_qkvz": "in_proj", "in_proj_ba": "in_proj", "out_proj": "out_proj"}
    _DELTA_PARAMS: ClassVar[dict[str, str]] = {"conv1d.weight": "conv_weight", "norm.weight": "norm_weight",
                                               "dt_bias": "dt_bias", "A_log": "A_log"}

    def weight_target(self, name: str) -> tuple[str, str | None] | tuple[str, str | None, int] | None:
        prefix, sep, rest = name.partition(".linear_attn.")
        if not sep or not prefix.startswith("model.layers."):
            return super().weight_target(name)
        layer = prefix[len("model.layers."):]
        module, _, param = rest.rpartition(".")
        if module in self._DELTA_LINEARS:
            return f"layers.{layer}.self_attn.{self._DELTA_LINEARS[module]}.{param}", module
        return f"layers.{layer}.self_attn.{self._DELTA_PARAMS.get(rest, rest)}", None

    def checkpoint_name(self, path: str, shard: str | None, expert: int | None = None) -> str:
        idx, _, tail = path.removeprefix("layers.").partition(".")
        if path.startswith("layers.") and self.config.layer_types[int(idx)] != ATTENTION \
                and tail.startswith("self_attn."):
            attr = tail[len("self_attn."):]
            inverse = {v: k for k, v in self._DELTA_PARAMS.items()}
            if shard is not None:
                attr = f"{shard}.{attr.rpartition('.')[2]}"
            return f"model.layers.{idx}.linear_attn.{inverse.get(attr, attr)}"
        return super().checkpoint_name(path, shard, expert)
