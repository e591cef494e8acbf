"""A Llama-family decoder in plain float32 PyTorch over the checkpoint's HF tensors.

The offline quantizers need what the engine hides: each linear layer's input
for whole calibration windows, layer by layer, with weights swapped in place
as they are quantized. So they run this small twin of ``lmplug_models.llama``
(same math: RMSNorm, rotate-half RoPE from ``lmplug.kit.rope``, causal GQA
attention, SwiGLU) on ``[windows, tokens, hidden]`` batches. Each decoder layer
is split into the pieces between linear inputs (``attn_input`` -> q/k/v ->
``attn_context`` -> o -> ``mlp_input`` -> gate/up -> ``down_input`` -> down),
so a driver can quantize one group of linears and feed the next group the
outputs of the quantized ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmplug.api import ModelConfig, ModelSource
from lmplug.errors import ConfigError
from lmplug.kit.rope import RotaryEmbedding

# the model types it runs, and what each implies (``ModelConfig.from_hf``'s facts)
SUPPORTED = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True, "window_flag": True},
             "qwen3": {"qk_norm": True, "window_flag": True}}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# act_quant(x) -> x as a W8A8 kernel would see it (fake-quantized activations), or None
ActQuant = Callable[[torch.Tensor], torch.Tensor] | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class FloatLlama:
    """``tensors``: HF name -> float32 tensor; quantizers replace entries in place."""

    linears = LINEARS  # each layer's linear layers

    def __init__(self, source: ModelSource, max_len: int = 4096) -> None:
        model_type = source.hf_config.get("model_type")
        if model_type not in SUPPORTED:
            raise ConfigError(f"{source.path}: offline quantization with calibration supports dense "
                              f"Llama-family models ({', '.join(SUPPORTED)}); this one is {model_type!r} "
                              "(rtn and fp8 need no calibration and take more families)")
        self.cfg = ModelConfig.from_hf(source.hf_config, **SUPPORTED[model_type])
        self.tensors = {name: t.float() for name, t in source.iter_tensors()
                        if "rotary_emb" not in name}
        c = self.cfg
        self.rope = RotaryEmbedding(c.head_dim, max(max_len, c.max_position_embeddings),
                                    c.rope_theta, c.rope_scaling, torch.float32)
        self.act_quant: ActQuant = None

    # -- tensors -------------------------------------------------------------------------
    def t(self, layer: int, name: str) -> torch.Tensor | None:
        return self.tensors.get(f"model.layers.{layer}.{name}")

    def weight(self, layer: int, linear: str) -> torch.Tensor:
        return self.tensors[f"model.layers.{layer}.{linear}.weight"]

    def set_weight(self, layer: int, linear: str, weight: torch.Tensor) -> None:
        self.tensors[f"model.layers.{layer}.{linear}.weight"] = weight.float()

    def linear(self, layer: int, linear: str, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant is not None:
            x = self.act_quant(x)
        return F.linear(x, self.weight(layer, linear), self.t(layer, f"{linear}.bias"))

    # -- the pieces of one decoder layer -------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.tensors["model.embed_tokens.weight"])

    def attn_input(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.t(i, "input_layernorm.weight"), self.cfg.rms_norm_eps)

    def attn_context(self, i: int, a: torch.Tensor, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of normed input ``a [B, L, h]`` up to o_proj's input ``[B, L, H * D]``.
        ``weights``: q/k/v weights to use instead of the stored ones (AWQ's search)."""
        c = self.cfg
        B, L, _ = a.shape

        def proj(name: str) -> torch.Tensor:
            key = f"self_attn.{name}"
            if weights is not None and key in weights:
                x = a if self.act_quant is None else self.act_quant(a)
                return F.linear(x, weights[key], self.t(i, f"{key}.bias"))
            return self.linear(i, key, a)

        q = proj("q_proj").view(B, L, c.num_heads, c.head_dim)
        k = proj("k_proj").view(B, L, c.num_kv_heads, c.head_dim)
        v = proj("v_proj").view(B, L, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, self.t(i, "self_attn.q_norm.weight"), c.rms_norm_eps)
            k = rms_norm(k, self.t(i, "self_attn.k_norm.weight"), c.rms_norm_eps)
        pos = torch.arange(L)
        cos, sin = self.rope.cos[pos].unsqueeze(1), self.rope.sin[pos].unsqueeze(1)  # [L, 1, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if c.sliding_window is not None and c.sliding_window < L:
            mask = torch.ones(L, L, dtype=torch.bool).tril()
            mask &= ~torch.ones(L, L, dtype=torch.bool).tril(-c.sliding_window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(B, L, c.num_heads * c.head_dim)

    def attn_output(self, i: int, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        return x + self.linear(i, "self_attn.o_proj", ctx)

    def mlp_input(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.t(i, "post_attention_layernorm.weight"), self.cfg.rms_norm_eps)

    def down_input(self, i: int, m: torch.Tensor) -> torch.Tensor:
        return F.silu(self.linear(i, "mlp.gate_proj", m)) * self.linear(i, "mlp.up_proj", m)

    def mlp_output(self, i: int, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return x + self.linear(i, "mlp.down_proj", d)

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_output(i, x, self.attn_context(i, self.attn_input(i, x)))
        return self.mlp_output(i, x, self.down_input(i, self.mlp_input(i, x)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.tensors["model.norm.weight"], self.cfg.rms_norm_eps)
        head = self.tensors.get("lm_head.weight", self.tensors["model.embed_tokens.weight"])
        return F.linear(x, head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, L, V]`` of token windows ``ids [B, L]``."""
        x = self.embed(ids)
        for i in range(self.cfg.num_layers):
            x = self.layer(i, x)
        return self.logits(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
