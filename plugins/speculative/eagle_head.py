"""EAGLE-1/2 draft heads in the published layout (SafeAILab/EAGLE): load, save, compute.

A folder holds ``config.json`` (a LlamaConfig with ``num_hidden_layers: 1``) and
``model.safetensors`` or ``pytorch_model.bin`` with

- ``fc.weight`` [h, 2h] (+ optional ``fc.bias``), applied to concat(embedding of token
  t+1, target feature at t) — the embedding first;
- ``layers.0.*``: one Llama decoder layer *without* ``input_layernorm``
  (``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``);
- optional ``embed_tokens.weight`` (else the target's embedding is used).

Optional, an lmplug extension in its own file (so the layout above stays the published one):
``draft_vocab.safetensors`` with ``token_ids``, the target tokens the head may draft (as
EAGLE-3's reduced draft vocabulary): the draft logits are then computed over those rows of
the ``lm_head`` only, the costliest part of a draft step for a small model.

The *feature* at position t is the target's final hidden state after its final norm (the
input of its ``lm_head``, ``base_model.model(...)[0]`` in EAGLE's ``ea_model.py``). The
head's output at t is its prediction of the feature at t+1; the target's ``lm_head``
turns it into logits for token t+2, with no norm in between (EAGLE's ``head(out_hidden)``).
Draft position t holds the pair (feature t, token t+1) at RoPE position t.

``EagleHead.layer(x, positions, attend)`` takes the attention as a function, so training
(dense causal SDPA over whole sequences) and the engine (the target's attention backend over
a KV cache of its own) run the same weights and the same code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lmplug.api import ModelConfig
from lmplug.errors import ConfigError
from lmplug.kit.rope import RotaryEmbedding

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
DRAFT_VOCAB = "draft_vocab.safetensors"  # optional, ours: tensor "token_ids" (int64, ascending)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, k, v [T, H, D] -> [T, H, D]


class _Norm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = torch.nn.Linear(h, q, bias=cfg.attention_bias)
        self.k_proj = torch.nn.Linear(h, kv, bias=cfg.attention_bias)
        self.v_proj = torch.nn.Linear(h, kv, bias=cfg.attention_bias)
        self.o_proj = torch.nn.Linear(q, h, bias=cfg.o_bias)


class _MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = torch.nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = torch.nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = torch.nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(torch.nn.Module):
    """A Llama decoder layer without input_layernorm (EAGLE's layer 0)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)


class EagleHead(torch.nn.Module):
    """fc over [embedding ‖ feature], then one decoder layer; state-dict keys are EAGLE's."""

    def __init__(self, cfg: ModelConfig, *, fc_bias: bool = True, own_embedding: bool = False,
                 max_position: int = 4096) -> None:
        super().__init__()
        if cfg.qk_norm or cfg.mla is not None or cfg.moe is not None:
            raise ConfigError("speculative: eagle: only Llama-style heads (no qk-norm, MLA or MoE) are supported")
        self.config = cfg
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = torch.nn.ModuleList([_Layer(cfg)])
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.rope = RotaryEmbedding(cfg.head_dim, max(max_position, cfg.max_position_embeddings),
                                    cfg.rope_theta, cfg.rope_scaling, torch.float32)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))

    def layer(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [T, h] (the fc output) -> the predicted next features [T, h]."""
        layer = self.layers[0]
        x = x + attention(layer.self_attn, self.config, self.rope, x, positions, attend)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def forward_dense(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """One whole sequence [T, h] with causal attention and no cache (training, tests)."""
        positions = torch.arange(embeds.shape[0], device=embeds.device)
        return self.layer(self.fuse(embeds, features), positions, causal_attention)

    def draft_feature(self, out: torch.Tensor) -> torch.Tensor:
        """What the target's ``lm_head`` reads of the head's output: the output itself."""
        return out


def attention(attn: _Attention, cfg: ModelConfig, rope: RotaryEmbedding, x: torch.Tensor,
              positions: torch.Tensor, attend: Attend) -> torch.Tensor:
    """A Llama attention block's output [T, h] over x [T, h]: q/k/v projections, RoPE, ``attend``, o_proj."""
    q = attn.q_proj(x).view(-1, cfg.num_heads, cfg.head_dim)
    k = attn.k_proj(x).view(-1, cfg.num_kv_heads, cfg.head_dim)
    v = attn.v_proj(x).view(-1, cfg.num_kv_heads, cfg.head_dim)
    if rope.cos.dtype != q.dtype:
        rope.to(q.dtype)
    q, k = rope(positions, q, k)
    return attn.o_proj(attend(q, k, v).reshape(-1, cfg.num_heads * cfg.head_dim))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention over one sequence: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


# -- files ----------------------------------------------------------------------------------------
def head_config(raw: dict) -> ModelConfig:
    raw = {"model_type": "llama", **raw}
    cfg = ModelConfig.from_hf(raw)
    if cfg.num_layers != 1:
        raise ConfigError(f"speculative: eagle: config.json has num_hidden_layers={cfg.num_layers}; "
                          f"EAGLE-1/2 heads have exactly 1 decoder layer")
    if cfg.hidden_act not in ("silu", "swish"):
        raise ConfigError(f"speculative: eagle: hidden_act {cfg.hidden_act!r} is not supported (silu)")
    return cfg


def load_head(path: str | Path, max_position: int = 4096) -> EagleHead:
    """Read a published-layout folder; raises ``ConfigError`` naming what is wrong."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ConfigError(f"speculative: eagle: no config.json in {folder}; train heads with "
                          f"`lmplug train-drafter --method eagle MODEL OUT`")
    state = _read_state(folder)
    state = {k: v for k, v in state.items() if "rotary_emb" not in k}
    cfg = head_config(json.loads(config_file.read_text()))
    fc = state.get("fc.weight")
    h = cfg.hidden_size
    if fc is None or tuple(fc.shape) != (h, 2 * h):
        raise ConfigError(f"speculative: eagle: {folder}: 'fc.weight' must be [{h}, {2 * h}] for hidden_size "
                          f"{h}, got {None if fc is None else tuple(fc.shape)}")
    head = EagleHead(cfg, fc_bias="fc.bias" in state, own_embedding="embed_tokens.weight" in state,
                     max_position=max_position)
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ConfigError(f"speculative: eagle: {folder}: tensors do not match a one-layer EAGLE head "
                          f"(missing {missing[:4]}, unexpected {unexpected[:4]}); note layers.0 has no "
                          f"input_layernorm")
    return head


def save_head(head: EagleHead, folder: str | Path, config: dict, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (the target's embedding is not copied)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS[0]))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHTS:
        file = folder / name
        if not file.exists():
            continue
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    raise ConfigError(f"speculative: eagle: no {' or '.join(WEIGHTS)} in {folder}; train heads with "
                      f"`lmplug train-drafter --method eagle MODEL OUT`")


def load_draft_vocab(folder: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The ids in ``draft_vocab.safetensors`` (None without the file); checked against the vocab."""
    file = Path(folder) / DRAFT_VOCAB
    if not file.exists():
        return None
    from safetensors.torch import load_file

    ids = load_file(str(file)).get("token_ids")
    if ids is None or ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(f"speculative: eagle: {file} must hold a non-empty 1-d tensor 'token_ids'")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError(f"speculative: eagle: {file}: token ids must lie in [0, {vocab_size})")
    return ids.unique()


def save_draft_vocab(ids: torch.Tensor, folder: str | Path) -> None:
    from safetensors.torch import save_file

    save_file({"token_ids": ids.long().unique().contiguous()}, str(Path(folder) / DRAFT_VOCAB))
