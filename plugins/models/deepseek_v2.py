"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over the MoE decoder.

Per layer, the query comes from a low-rank path (``q_a_proj`` -> ``q_a_layernorm``
-> ``q_b_proj``) or a plain ``q_proj`` (V2-Lite); keys and values come from one
latent vector per token (``kv_a_proj_with_mqa`` -> split -> ``kv_a_layernorm``)
plus one RoPE key shared by all heads. RoPE (DeepSeek's interleaved pairs)
touches only the rope slices. The attention backend (an ``MLAAttentionBackend``)
caches ``[latent | k_pe]`` and gets ``kv_b_proj`` split per head, so it can
expand the latent (prefill) or absorb the matrices (decode). The feed-forward
blocks are the MoE decoder's: dense below ``first_k_dense_replace``, DeepSeek's
routed + shared experts above (``moe_config.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from lmplug_models.moe import MoEForCausalLM

from lmplug.api import (
    AttentionBackend,
    KVLayerView,
    MLAAttentionBackend,
    ModelConfig,
    MoEBackend,
    QuantMethod,
    StepContext,
)
from lmplug.errors import ModelLoadError
from lmplug.kit.layers import Linear, RMSNorm
from lmplug.kit.parallel import ParallelState
from lmplug.kit.rope import RotaryEmbedding

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps

class MLAttention(torch.nn.Module):
    """x [T, h] -> [T, h] through the latent; the backend owns the cache and the attention math."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                 backend: MLAAttentionBackend) -> None:
        super().__init__()
        m = cfg.mla
        self.layer, self.backend, self.mla = layer, backend, m
        self.num_heads = cfg.num_heads
        h, heads, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias

        def linear(name: str, n_in: int, n_out: int, with_bias: bool = False) -> Linear:
            return Linear(n_in, {name: n_out}, bias=with_bias, dtype=dtype, quant=quant)

        q_out = heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = linear("q_proj", h, q_out)
        else:
            self.q_a_proj = linear("q_a_proj", h, m.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = linear("q_b_proj", m.q_lora_rank, q_out)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", h, m.latent_dim, bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = linear("kv_b_proj", m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = linear("o_proj", heads * m.v_head_dim, h, bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` per head: w_uk [H, nope, R] (key rows) and w_uv [H, V, R] (value rows)."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def _rope(self, rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return rope.rotate_pairs(positions, x) if self.mla.rope_interleave else rope.rotate(positions, x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        m = self.mla
        q = self._query(x).view(-1, self.num_heads, m.qk_head_dim)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_pe = self._rope(rope, positions, q_pe)  # [T, H, rope]
        k_pe = self._rope(rope, positions, k_pe.unsqueeze(1)).squeeze(1)  # [T, rope]
        w_uk, w_uv = self.absorbed_weights()
        out = self.backend.forward_mla(self.layer, q_nope, q_pe, latent, k_pe, w_uk, w_uv, kv, ctx)
        return self.o_proj(out.reshape(-1, self.num_heads * m.v_head_dim))  # out: [T, H, V]


def _own(*names: str) -> dict[str, tuple[str, str]]:
    """Checkpoint module -> (our module, shard) for linears that are one shard named as HF names them."""
    return {f"self_attn.{n}": (f"self_attn.{n}", n) for n in names}


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """The MoE decoder whose attention is ``MLAttention`` (needs an MLA attention backend)."""

    STACKED: ClassVar[dict[str, tuple[str, str]]] = {
        **{k: v for k, v in MoEForCausalLM.STACKED.items()
           if not k.startswith(("self_attn.", "mlp.shared_expert."))},
        **_own("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
        "mlp.shared_experts.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate_proj"),
        "mlp.shared_experts.up_proj": ("mlp.shared_expert.gate_up_proj", "up_proj"),
        "mlp.shared_experts.down_proj": ("mlp.shared_expert.down_proj", "down_proj"),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod,
                 attention: AttentionBackend, max_model_len: int, *, moe: MoEBackend,
                 parallel: ParallelState | None = None) -> None:
        if cfg.mla is None:
            raise ModelLoadError(f"model_type {cfg.model_type!r} has no multi-head latent attention")
        if not isinstance(attention, MLAAttentionBackend):
            raise ModelLoadError(f"a {cfg.model_type} model needs an MLA attention backend, "
                                 f"got {type(attention).__name__}")
        # the base class sizes its RoPE table by cfg.head_dim, which transformers sets to the rope dims
        super().__init__(cfg, dtype, quant, attention, max_model_len, moe=moe, parallel=parallel)
        if self.rope.cos.shape[-1] != cfg.mla.qk_rope_head_dim:
            self.rope = RotaryEmbedding(cfg.mla.qk_rope_head_dim,
                                        max(max_model_len, cfg.max_position_embeddings),
                                        cfg.rope_theta, cfg.rope_scaling, dtype)

    def make_attention(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                       backend: AttentionBackend) -> torch.nn.Module:
        return MLAttention(cfg, layer, dtype, quant, backend)
