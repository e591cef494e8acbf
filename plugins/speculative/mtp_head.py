"""A multi-token-prediction module as plain torch, for training one (``mtp_train.py``).

The engine never runs this class: it loads the saved weights through the core
(``DraftTarget.open_mtp``), which builds the module's decoder layer as one of the target's. This
class computes the same thing densely (causal attention over one whole sequence, no cache) for a
Llama-style target, with DeepSeek-V3's tensor names:

    out_t = Layer(eh_proj([enorm(Emb(token_{t+1})) ; hnorm(f_t)]))      (a full decoder layer)
    logits_{t+2} = lm_head(shared_head.norm(out_t))                     (the target's lm_head)

``save_mtp`` writes them as DeepSeek-V3 / GLM-4.5 checkpoints hold them, under
``model.layers.{L}.`` (L: the target's number of layers), with a ``config.json`` that names the
target's shape and ``num_nextn_predict_layers: 1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lmplug_speculative.eagle_head import _MLP, _Attention, _Norm, attention, causal_attention

from lmplug.api import ModelConfig
from lmplug.errors import ConfigError
from lmplug.kit.rope import RotaryEmbedding

WEIGHTS = "model.safetensors"


class _SharedHead(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(torch.nn.Module):
    """One MTP module for a Llama-style target; state-dict keys are DeepSeek-V3's (without the
    ``model.layers.{L}.`` prefix)."""

    def __init__(self, cfg: ModelConfig, max_position: int = 4096) -> None:
        super().__init__()
        if cfg.qk_norm or cfg.mla is not None or cfg.moe is not None or cfg.hidden_act not in ("silu", "swish"):
            raise ConfigError("train-drafter mtp: only Llama-style targets (no qk-norm, MLA or MoE; silu) can "
                              "get a trained MTP module")
        h = cfg.hidden_size
        self.config = cfg
        self.enorm = _Norm(h, cfg.rms_norm_eps)
        self.hnorm = _Norm(h, cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = _Norm(h, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _Norm(h, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)
        self.shared_head = _SharedHead(cfg)
        # cos/sin are non-persistent buffers: not in the state dict
        self.rope = RotaryEmbedding(cfg.head_dim, max(max_position, cfg.max_position_embeddings),
                                    cfg.rope_theta, cfg.rope_scaling, torch.float32)

    def forward_dense(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The module's outputs [T, h] over one sequence: position t sees (token t+1, f_t)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features.to(embeds.dtype))], dim=-1))
        positions = torch.arange(x.shape[0], device=x.device)
        x = x + attention(self.self_attn, self.config, self.rope, self.input_layernorm(x), positions,
                          causal_attention)
        return x + self.mlp(self.post_attention_layernorm(x))

    def draft_feature(self, out: torch.Tensor) -> torch.Tensor:
        """What the target's ``lm_head`` reads: the output after the head's norm."""
        return self.shared_head.norm(out)


def save_mtp(head: MTPHead, folder: str | Path, base_model: str, dtype: torch.dtype = torch.float32) -> Path:
    """``model.safetensors`` with ``model.layers.{L}.*`` and a ``config.json`` of the target's shape."""
    from safetensors.torch import save_file

    cfg = head.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"model.layers.{cfg.num_layers}."
    state = {prefix + k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    config = {"model_type": cfg.model_type, "num_hidden_layers": cfg.num_layers, "num_nextn_predict_layers": 1,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "base_model_name_or_path": base_model,
              "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
