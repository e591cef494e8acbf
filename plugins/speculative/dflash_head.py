"""A DFlash masked block-diffusion head (transformers' ``muse_glimmer_assistant``): load and compute.

A folder holds ``config.json`` (``model_type: muse_glimmer_assistant``; ``block_size``,
``mask_token_id``, ``target_layer_ids`` beside Llama's keys) and ``model.safetensors`` with

- ``encoder.fc.weight`` [h, n h] and ``encoder.output_norm_enc.weight``: the *context*, the
  concatenated hidden states of the target's layers ``target_layer_ids`` (n of them) projected
  to h and RMS-normed;
- ``layers.N.*``: decoder layers (q/k/v/o, q/k RMSNorms over each head, SwiGLU MLP) whose
  queries come from the block only while keys and values come from [context ‖ block];
- ``norm.weight``: the final norm. There is no embedding or LM head: the block's input is the
  target's embedding of [anchor, mask × (block_size - 1)], its output goes through the
  target's LM head (``DFlashTokenCandidateGenerator``).

The block attends bidirectionally to the context and to itself (sliding layers: to positions
within ``sliding_window`` either way). The K/V of a context position depends only on the
target's hidden states there and its position, so they are computed once (``context_kv``)
and kept, as transformers' ``DFlashCache`` keeps them; the block's K/V never outlives a
forward (the reference crops it from its cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lmplug_speculative.eagle_head import _MLP, _Norm  # Llama's, as this head has them

from lmplug.api import ConfigReader, ModelConfig, ModelLoadError
from lmplug.errors import ConfigError
from lmplug.kit.rope import RotaryEmbedding

MODEL_TYPE = "muse_glimmer_assistant"
WEIGHTS = "model.safetensors"
DEFAULT_THETA = 500000.0  # MuseGlimmerAssistantConfig.default_theta


@dataclass(frozen=True)
class DFlashConfig:
    model: ModelConfig  # the decoder fields (hidden size, heads, rope, eps, ...)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding: tuple[bool, ...]  # per layer: a sliding-window layer
    sliding_window: int


def _linear(n_in: int, n_out: int) -> torch.nn.Linear:
    return torch.nn.Linear(n_in, n_out, bias=False)


class _Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj, self.o_proj = _linear(h, cfg.num_heads * d), _linear(cfg.num_heads * d, h)
        self.k_proj, self.v_proj = _linear(h, cfg.num_kv_heads * d), _linear(h, cfg.num_kv_heads * d)
        self.q_norm, self.k_norm = _Norm(d, cfg.rms_norm_eps), _Norm(d, cfg.rms_norm_eps)


class _Layer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)


class _Encoder(torch.nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h = cfg.model.hidden_size
        self.fc = _linear(len(cfg.target_layer_ids) * h, h)
        self.output_norm_enc = _Norm(h, cfg.model.rms_norm_eps)


class DFlashHead(torch.nn.Module):
    """State-dict keys are transformers' ``MuseGlimmerAssistantModel``'s."""

    def __init__(self, cfg: DFlashConfig, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        m = cfg.model
        self.encoder = _Encoder(cfg)
        self.layers = torch.nn.ModuleList(_Layer(m) for _ in range(m.num_layers))
        self.norm = _Norm(m.hidden_size, m.rms_norm_eps)
        self.rope = RotaryEmbedding(m.head_dim, max(max_position, m.max_position_embeddings), m.rope_theta,
                                    m.rope_scaling, torch.float32)

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The context [T, h] from the target's layer outputs concatenated [T, n h]."""
        return self.encoder.output_norm_enc(self.encoder.fc(target_hidden))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V [Hkv, T, D] of context rows [T, h] at ``positions`` [T]."""
        return [self._kv(layer.self_attn, context, positions) for layer in self.layers]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor,
                past: list[tuple[torch.Tensor, torch.Tensor]], past_positions: torch.Tensor,
                past_valid: torch.Tensor) -> torch.Tensor:
        """The block's output [B, S, h] (after the final norm) from its input embeddings [B, S, h]
        at ``positions`` [B, S], over each layer's cached context K/V ``past`` ([B, Hkv, P, D],
        padded) at ``past_positions`` [B, P] where ``past_valid`` [B, P] is True."""
        cfg, m = self.config, self.config.model
        b, s, _ = embeds.shape
        key_pos = torch.cat([past_positions, positions], 1)  # [B, P + S]
        valid = torch.cat([past_valid, past_valid.new_ones(b, s)], 1)
        near = (positions[:, :, None] - key_pos[:, None, :]).abs() <= cfg.sliding_window
        masks = {False: valid[:, None, None, :], True: (valid[:, None, :] & near)[:, None]}
        flat = positions.reshape(-1)
        x = embeds
        for layer, (pk, pv), sliding in zip(self.layers, past, cfg.sliding):
            attn = layer.self_attn
            h = layer.input_layernorm(x).reshape(b * s, -1)
            q = attn.q_norm(attn.q_proj(h).view(b * s, m.num_heads, m.head_dim))
            q = self._rope().rotate(flat, q).view(b, s, m.num_heads, m.head_dim).transpose(1, 2)
            k, v = self._kv(attn, h, flat)  # [Hkv, B S, D]
            k = k.view(m.num_kv_heads, b, s, m.head_dim).transpose(0, 1)
            v = v.view(m.num_kv_heads, b, s, m.head_dim).transpose(0, 1)
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[sliding], scale=m.head_dim ** -0.5,
                                                 enable_gqa=m.num_heads != m.num_kv_heads)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def _kv(self, attn: _Attention, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.config.model
        k = attn.k_norm(attn.k_proj(x).view(-1, m.num_kv_heads, m.head_dim))
        v = attn.v_proj(x).view(-1, m.num_kv_heads, m.head_dim)
        return self._rope().rotate(positions, k).transpose(0, 1), v.transpose(0, 1)

    def _rope(self) -> RotaryEmbedding:
        dtype = self.encoder.fc.weight.dtype
        if self.rope.cos.dtype != dtype:
            self.rope.to(dtype)
        return self.rope


# -- files ----------------------------------------------------------------------------------------
def read_config(raw: dict, where: str) -> DFlashConfig:
    """The head's config; ``ModelLoadError`` (naming the file and key) on a bad value."""
    r = ConfigReader(raw, where)
    if raw.get("model_type") != MODEL_TYPE:
        r.fail("model_type", f"is {raw.get('model_type')!r}; a DFlash head is {MODEL_TYPE!r}")
    if r.text("hidden_act", "silu") not in ("silu", "swish"):
        r.fail("hidden_act", "must be silu")
    params = r.mapping("rope_parameters") or {}
    if r.number("rope_theta", None) is None and "rope_theta" not in params:
        raw = {**raw, "rope_parameters": {"rope_type": "default", **params, "rope_theta": DEFAULT_THETA}}
    # no embedding of its own: the target's vocabulary is checked by the drafter
    model = ModelConfig.from_hf({"vocab_size": 1, **raw, "model_type": "llama"}, where, qk_norm=True)
    n = model.num_layers
    layer_types = raw.get("layer_types") or ["sliding_attention"] * n
    if (not isinstance(layer_types, list) or len(layer_types) != n
            or not set(layer_types) <= {"sliding_attention", "full_attention"}):
        r.fail("layer_types", f"must list {n} of 'sliding_attention' / 'full_attention'")
    ids = raw.get("target_layer_ids", [1, 13, 25, 37, 49])
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        r.fail("target_layer_ids", f"must be a non-empty list of layer indices, got {ids!r}")
    return DFlashConfig(model, r.int("block_size", 16, low=2, high=64), r.int("mask_token_id", 201818, low=0),
                        tuple(ids), tuple(t == "sliding_attention" for t in layer_types),
                        r.int("sliding_window", 2048))


def load_head(path: str | Path, max_position: int) -> DFlashHead:
    """Read a ``muse_glimmer_assistant`` folder; raises ``ConfigError`` naming what is wrong."""
    folder = Path(path)
    config_file, weights = folder / "config.json", folder / WEIGHTS
    for file in (config_file, weights):
        if not file.exists():
            raise ConfigError(f"speculative: dflash: heads: no {file.name} in {folder}; expected a "
                              f"{MODEL_TYPE} checkpoint (config.json + {WEIGHTS})")
    try:
        cfg = read_config(json.loads(config_file.read_text()), str(config_file))
    except (ModelLoadError, json.JSONDecodeError) as e:
        raise ConfigError(f"speculative: dflash: heads: {e}") from e
    from safetensors.torch import load_file

    state = {k.removeprefix("model."): v for k, v in load_file(str(weights)).items() if "rotary_emb" not in k}
    head = DFlashHead(cfg, max_position)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        diff = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
        raise ConfigError(f"speculative: dflash: heads: {weights} does not match its config.json "
                          f"({', '.join(f'{k}: {got.get(k)} != {expected.get(k)}' for k in diff[:4])})")
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head
