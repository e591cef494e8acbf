"""DiffusionGemma (``diffusion_gemma``, transformers' ``DiffusionGemmaForBlockDiffusion``): one
Gemma 4 MoE text backbone run two ways. The encoder runs causally over the prompt and each
committed canvas and is the only writer of the KV cache; the decoder runs over a canvas of noisy
tokens, bidirectionally over the cached prefix and the whole canvas, with a self-conditioning
signal from the previous denoising step's logits added to its input.

In a step both may run, for different sequences: a row with a query mask
(``StepContext.query_masks``, all ones over its canvas) is a decoder row, whose self-conditioning
logits come in ``StepContext.row_inputs``; every other row is an encoder row. Each layer attends
the two groups in two backend calls. A decoder row's K/V go to its canvas slots, which the
encoder pass of the committed canvas overwrites (the select stage rolls the computed count back:
``lmplug.diffusion``), so the cache holds only the encoder's K/V, as transformers' decoder's
``append_to_cache`` leaves it.

The decoder's sliding layers see the last ``sliding_window - 1`` cached tokens and the whole canvas
(transformers' dynamic sliding cache). The backends place a query-masked row's tokens at position
``start + depth``, an all-ones canvas at ``start + canvas - 1``, so the decoder attends through
layer ids ``num_layers + i`` whose window is ``sliding_window + canvas_length - 1``: the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lmplug_models.blocks import SLIDING
from lmplug_models.gemma4 import Gemma4ForCausalLM, Gemma4Layer, _unit_rms, gemma4_options

from lmplug.api import ConfigReader, LayerAttention, ModelConfig, StepContext
from lmplug.kit.layers import RMSNorm

MAX_CANVAS = 4096


def diffusion_text_config(hf_config: dict[str, Any], where: str) -> dict[str, Any]:
    """The Gemma 4 text config of a ``diffusion_gemma`` config.json (its ``text_config``) with what
    DiffusionGemma implies: K as V on full layers, the MoE block in every layer, no per-layer
    embeddings, a final soft-cap of 30 by default; ``canvas_length`` checked and carried."""
    r = ConfigReader(hf_config, where)
    text = r.mapping("text_config")
    if text is None:
        r.fail("text_config", "is missing: a diffusion_gemma config.json holds its backbone there")
    canvas = r.int("canvas_length", 256, high=MAX_CANVAS)
    tied = r.flag("tie_word_embeddings", True)
    return {"final_logit_softcapping": 30.0, **text, "model_type": "diffusion_gemma_text",
            "attention_k_eq_v": True, "enable_moe_block": True, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0, "canvas_length": canvas, "tie_word_embeddings": tied}


def diffusion_layers(cfg: ModelConfig) -> tuple[LayerAttention, ...]:
    """The encoder's layers (causal, windows by position), then the decoder's views of them: scale
    1.0, sliding layers' window widened by the canvas (module docstring)."""
    opts = gemma4_options(cfg)
    canvas = cfg.raw["canvas_length"]
    encoder = [LayerAttention(1.0, opts.window if kind == SLIDING else None) for kind in opts.kinds]
    decoder = [LayerAttention(1.0, opts.window + canvas - 1 if kind == SLIDING else None) for kind in opts.kinds]
    return tuple(encoder + decoder)


@dataclass
class _Part:
    """One group of the step's rows: its own context, its tokens' indices, its layer id offset."""

    ctx: StepContext
    tokens: torch.Tensor
    layer_offset: int


def sub_context(ctx: StepContext, rows: list[int]) -> tuple[StepContext, torch.Tensor]:
    """The step's context restricted to ``rows`` (batch indices, in step order) and the indices
    of their tokens in the step."""
    starts = [0]
    for n in ctx.query_lens_cpu:
        starts.append(starts[-1] + n)
    device = ctx.positions.device
    tokens = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in rows]).to(device)
    index = torch.tensor(rows, device=device)
    query_lens = [ctx.query_lens_cpu[b] for b in rows]
    seq_lens = [ctx.seq_lens_cpu[b] for b in rows]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0, out=cu[1:])
    decodes = 0
    while decodes < len(rows) and query_lens[decodes] == 1 and seq_lens[decodes] > 1:
        decodes += 1
    return StepContext(
        positions=ctx.positions[tokens], query_lens=ctx.query_lens[index], seq_lens=ctx.seq_lens[index],
        cu_query_lens=cu.to(device), slot_mapping=ctx.slot_mapping[tokens], block_tables=ctx.block_tables[index],
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, num_decodes=decodes,
        query_masks={j: ctx.query_masks[b] for j, b in enumerate(rows) if b in ctx.query_masks},
        row_inputs={j: ctx.row_inputs[b] for j, b in enumerate(rows) if b in ctx.row_inputs}), tokens


class SelfConditioning(torch.nn.Module):
    """``post_norm(x + down(gelu(gate(n)) * up(n)))`` with ``n = pre_norm(soft embeddings)``;
    ``post_norm`` has no weight."""

    def __init__(self, hidden: int, inter: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.pre_norm = RMSNorm(hidden, eps, dtype)
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.eps = eps
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        n = self.pre_norm(soft)
        return _unit_rms(x + self.down_proj(F.gelu(self.gate_proj(n), approximate="tanh") * self.up_proj(n)), self.eps)


class DiffusionGemmaLayer(Gemma4Layer):
    """A Gemma 4 MoE layer with the encoder's own ``layer_scalar`` beside the decoder's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.encoder_layer_scalar = torch.nn.Parameter(torch.ones_like(self.layer_scalar), requires_grad=False)

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv, parts: list[_Part]) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x), positions)
        if len(parts) == 1:
            part = parts[0]
            out = attn.backend.forward(attn.layer + part.layer_offset, q, k, v, kv, part.ctx)
        else:
            out = torch.empty_like(q)
            for part in parts:
                t = part.tokens
                out[t] = attn.backend.forward(attn.layer + part.layer_offset, q[t], k[t], v[t], kv, part.ctx)
        h = self.feed_forward(x + self.post_attention_layernorm(attn.o_proj(out.reshape(-1, attn.q_size))))
        for part in parts:  # the encoder's scalar on its rows, the decoder's on the canvas rows
            scalar = self.layer_scalar if part.layer_offset else self.encoder_layer_scalar
            if len(parts) == 1:
                return h * scalar
            h[part.tokens] = h[part.tokens] * scalar
        return h


class DiffusionGemmaForBlockDiffusion(Gemma4ForCausalLM):
    """DiffusionGemma's encoder and decoder over one set of weights (module docstring)."""

    block_diffusion = True  # what ``lmplug.diffusion`` looks for: this model denoises canvases

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant, attention, max_model_len: int, *,
                 parallel=None) -> None:
        super().__init__(cfg, dtype, quant, attention, max_model_len, parallel=parallel)
        self.canvas_length = cfg.raw["canvas_length"]
        self.self_conditioning = SelfConditioning(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, dtype)

    layer_class = DiffusionGemmaLayer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * torch.tensor(self.embedding_multiplier, dtype=self.lm_dtype)
        canvases = sorted(ctx.query_masks)
        plain = [b for b in range(ctx.num_seqs) if b not in ctx.query_masks]
        parts = []
        if plain:
            parts.append(_Part(*(sub_context(ctx, plain) if canvases else (ctx, None)), 0))
        if canvases:
            dec_ctx, tokens = sub_context(ctx, canvases) if plain else (ctx, torch.arange(x.shape[0], device=x.device))
            parts.append(_Part(dec_ctx, tokens, len(self.layers)))
            x[tokens] = self.self_condition(x[tokens], [ctx.row_inputs.get(b) for b in canvases],
                                            [ctx.query_lens_cpu[b] for b in canvases])
        for layer, kv in zip(self.layers, self.kv_views):
            x = layer.run(x, positions, kv, parts)
        return self.norm(x)

    @property
    def lm_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def self_condition(self, x: torch.Tensor, logits: list[torch.Tensor | None], lens: list[int]) -> torch.Tensor:
        """The decoder's input: each canvas's embeddings with the soft embeddings of its previous
        step's (temperature-scaled) logits, zeros at the first step."""
        table = self.embed_tokens.weight
        soft = []
        for rows, n in zip(logits, lens):
            if rows is None:
                soft.append(torch.zeros(n, x.shape[-1], dtype=x.dtype, device=x.device))
            else:
                probs = rows.softmax(dim=-1, dtype=torch.float32).to(table.dtype)
                soft.append(probs @ table * torch.tensor(self.embedding_multiplier, dtype=x.dtype))
        return self.self_conditioning(x, torch.cat(soft))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head).float()
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    # -- checkpoint names: the decoder's (transformers ties the encoder's to them) ---------------
    def weight_target(self, name: str):
        if name.startswith("model.encoder.language_model.layers.") and name.endswith(".layer_scalar"):
            idx = name.split(".")[4]
            return f"layers.{idx}.encoder_layer_scalar", None
        if name.startswith("model.decoder.self_conditioning."):
            return name[len("model.decoder."):], None
        if name.startswith("model.decoder."):
            return super().weight_target("model." + name[len("model.decoder."):])
        if name == "lm_head.weight":
            return super().weight_target(name)
        return None  # the encoder's tied copies, the vision tower: not used for text

    def checkpoint_name(self, path: str, shard: str | None) -> str:
        if path.endswith("encoder_layer_scalar"):
            return f"model.encoder.language_model.{path.replace('encoder_layer_scalar', 'layer_scalar')}"
        if path.startswith("self_conditioning."):
            return "model.decoder." + path
        name = super().checkpoint_name(path, shard)
        return "model.decoder." + name[len("model."):] if name.startswith("model.") else name

