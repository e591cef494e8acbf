"""BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa) for embeddings: the checkpoints most
sentence-transformers models are (all-MiniLM, bge, e5, gte, multilingual-e5 ...).

An encoder attends in both directions over the whole prompt, so it never runs a prompt in
chunks or reuses a cached prefix: the ``encoder`` feature tells the engine plan so (each
embedding prompt is scheduled whole, ``Sequence.whole_prompt``), and generation is refused. The
KV cache is not read: attention runs over the step's own rows of each sequence.

The layers are post-norm (``LayerNorm(x + sublayer(x))``) with biases everywhere, absolute
position embeddings (RoBERTa's start after the padding index: ``padding_idx + 1 + i``) and one
token type (0), as sentence-transformers and HF ``BertModel`` run them for a single text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from lmplug.api import (
    ENCODER,
    Architecture,
    Capabilities,
    ConfigReader,
    ModelConfig,
    StepContext,
)
from lmplug.errors import ModelLoadError
from lmplug.kit.layers import Linear

# checkpoint module (after "encoder.layer.N.") -> (module path in our layer, shard)
_STACKED = {
    "attention.self.query": ("qkv", "query"),
    "attention.self.key": ("qkv", "key"),
    "attention.self.value": ("qkv", "value"),
    "attention.output.dense": ("attn_out", "dense"),
    "intermediate.dense": ("intermediate", "dense"),
    "output.dense": ("output", "dense"),
}
_NORMS = {"attention.output.LayerNorm": "attn_norm", "output.LayerNorm": "out_norm"}
# what sentence-transformers' BertModel checkpoints carry beside the encoder, which pooling never reads
_SKIPPED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids")
_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
                "silu": F.silu, "swish": F.silu}


def _layer_norm(hidden: int, eps: float, dtype: torch.dtype) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(hidden, eps=eps, dtype=dtype)
    norm.requires_grad_(False)
    return norm


class EncoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float, dtype: torch.dtype, quant: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.qkv = Linear(h, {"query": h, "key": h, "value": h}, bias=True, dtype=dtype, quant=quant)
        self.attn_out = Linear(h, {"dense": h}, bias=True, dtype=dtype, quant=quant)
        self.attn_norm = _layer_norm(h, eps, dtype)
        self.intermediate = Linear(h, {"dense": cfg.intermediate_size}, bias=True, dtype=dtype, quant=quant)
        self.output = Linear(cfg.intermediate_size, {"dense": h}, bias=True, dtype=dtype, quant=quant)
        self.out_norm = _layer_norm(h, eps, dtype)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, same_seq: torch.Tensor | None) -> torch.Tensor:
        """``same_seq``: bool [T, T], rows of one sequence (None: the step is one sequence)."""
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3).unbind(0)  # [H, T, D]
        # each sequence attends over its own rows, both ways: one call for the step
        attn = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=same_seq)[0]
        x = self.attn_norm(x + self.attn_out(attn.transpose(0, 1).reshape(x.shape)))
        return self.out_norm(x + self.output(self.act(self.intermediate(x))))


class BertEncoder(torch.nn.Module):
    """``forward(input_ids [T], positions [T], ctx) -> hidden [T, h]``: the last layer's output,
    which pooling reads (``final_hidden_states``); there is no LM head."""

    final_hidden_states = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: Any, max_model_len: int) -> None:
        super().__init__()
        r = ConfigReader(cfg.raw, "config.json")
        eps = r.number("layer_norm_eps", 1e-12)
        self.config = cfg
        # RoBERTa numbers positions from padding_idx + 1; BERT from 0
        self.position_offset = (r.int("pad_token_id", 1, low=0) + 1) if cfg.model_type in _ROBERTA else 0
        self.word_embeddings = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = torch.nn.Embedding(r.int("max_position_embeddings"), cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = torch.nn.Embedding(r.int("type_vocab_size", 2), cfg.hidden_size, dtype=dtype)
        self.embed_norm = _layer_norm(cfg.hidden_size, eps, dtype)
        self.layers = torch.nn.ModuleList(EncoderLayer(cfg, eps, dtype, quant) for _ in range(cfg.num_layers))
        self.requires_grad_(False)

    def bind_kv(self, views: list) -> None:
        """Nothing is cached: an encoder reads only the step's own rows."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        same_seq = self._same_sequence(ctx, input_ids.device)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
             + self.token_type_embeddings.weight[0])
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, same_seq)
        return x

    def _same_sequence(self, ctx: StepContext, device: torch.device) -> torch.Tensor | None:
        """bool [T, T]: which rows belong to one sequence (None: only one); every sequence's rows
        must be its whole prompt (the plan schedules them so)."""
        for i, (new, total) in enumerate(zip(ctx.query_lens_cpu, ctx.seq_lens_cpu)):
            if new != total:
                raise RuntimeError(f"encoder {self.config.model_type!r}: sequence {i} of the step has {new} of its "
                                   f"{total} tokens; an encoder needs each prompt in one step (the scheduler "
                                   "split it: use one that keeps Sequence.whole_prompt)")
        if ctx.num_seqs == 1:
            return None
        seq = torch.repeat_interleave(torch.arange(ctx.num_seqs, device=device), ctx.query_lens.to(device).long())
        return seq[:, None] == seq[None, :]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"encoder {self.config.model_type!r} has no LM head: it embeds, never generates")

    def weight_target(self, name: str) -> tuple[str, str | None] | None:
        for prefix in ("bert.", "roberta.", "model."):  # a *ForMaskedLM checkpoint's base model
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.startswith(_SKIPPED):
            return None
        if name.startswith("embeddings."):
            tail = name[len("embeddings."):]
            return ("embed_norm." + tail.partition(".")[2] if tail.startswith("LayerNorm.") else tail), None
        if name.startswith("encoder.layer."):
            idx, _, tail = name[len("encoder.layer."):].partition(".")
            module, _, param = tail.rpartition(".")
            if module in _STACKED:
                path, shard = _STACKED[module]
                return f"layers.{idx}.{path}.{param}", shard
            if module in _NORMS:
                return f"layers.{idx}.{_NORMS[module]}.{param}", None
        return name, None  # the loader names a tensor that fills nothing

    def checkpoint_name(self, path: str, shard: str | None) -> str:
        if path.startswith("layers."):
            idx, _, tail = path[len("layers."):].partition(".")
            module, _, param = tail.rpartition(".")
            for hf_module, (target, target_shard) in _STACKED.items():
                if (target, target_shard) == (module, shard):
                    return f"encoder.layer.{idx}.{hf_module}.{param}"
            for hf_module, target in _NORMS.items():
                if target == module:
                    return f"encoder.layer.{idx}.{hf_module}.{param}"
        if path.startswith("embed_norm."):
            return "embeddings.LayerNorm." + path.partition(".")[2]
        return "embeddings." + path


_ROBERTA = ("roberta", "xlm-roberta")


class BertArchitecture(Architecture):
    """BERT, RoBERTa and XLM-RoBERTa encoders, for embeddings only (``ENCODER``)."""

    name = "bert"
    model_types = ("bert",) + _ROBERTA
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), features=frozenset({ENCODER}), priority=10)

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        cfg = dict(hf_config)
        r = ConfigReader(cfg, where)
        kind = r.text("position_embedding_type", "absolute")
        if kind != "absolute":
            r.fail("position_embedding_type", f"is {kind!r}; lmplug's encoders have absolute positions only")
        act = r.text("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            r.fail("hidden_act", f"is {act!r}; expected one of {', '.join(_ACTIVATIONS)}")
        if r.int("hidden_size") % r.int("num_attention_heads"):
            r.fail("num_attention_heads", "must divide hidden_size")
        config = ModelConfig.from_hf(cfg, where)
        # RoBERTa's table has padding_idx + 1 rows before the first position
        offset = (r.int("pad_token_id", 1, low=0) + 1) if cfg.get("model_type") in _ROBERTA else 0
        positions = r.int("max_position_embeddings") - offset
        if positions < 1:
            raise ModelLoadError(f"{where}: max_position_embeddings {positions + offset} leaves no position after "
                                 f"RoBERTa's offset of {offset}")
        return dataclasses.replace(config, max_position_embeddings=positions, hidden_act=act,
                                   num_kv_heads=config.num_heads)

    def build(self, model_config: ModelConfig, *, dtype: Any, quant: Any, attention: Any,
              max_model_len: int, parallel: Any, moe: Any = None, mixer: Any = None) -> torch.nn.Module:
        return BertEncoder(model_config, dtype, quant, max_model_len)
