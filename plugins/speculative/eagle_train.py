"""Train an EAGLE-1/2 head for any model on text the model generates itself.

    lmplug train-drafter --method eagle MODEL OUT [-o epochs=4 -o num_prompts=48 ...]

1. The target answers built-in instructions (``medusa_train.generate_answers``: its chat
   template, greedy by default), so the head learns *this model's* continuations.
2. One prefill forward per answer gives the target's features f_t (final hidden state after
   the final norm) at every position.
3. The head sees (embedding of token t+1, f_t) at position t and predicts f_{t+1}. Loss, as
   in EAGLE: smooth-L1 between the prediction and f_{t+1}, plus ``cls_weight`` x the
   cross-entropy of the target's next-token distribution softmax(lm_head(f_{t+1})) under
   lm_head(prediction) (the lm_head and the embedding stay frozen: they are the target's).
4. fc starts as "pass the feature through" plus small random weights on the embedding half,
   the layer random with its residual branches zeroed (``init_from_target``: a copy of the
   target's last layer minus its input norm instead).
5. Saved in the published layout (``config.json`` + ``model.safetensors``, no embedding:
   the drafter uses the target's), plus ``draft_vocab.safetensors``: the ``draft_vocab``
   most frequent tokens of the answers, the only ones the drafter then drafts (cheaper).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from lmplug_speculative.eagle_head import EagleHead, head_config, save_draft_vocab, save_head
from lmplug_speculative.head_matrix import head_matrix
from lmplug_speculative.medusa_train import generate_answers, open_target
from pydantic import BaseModel, ConfigDict, Field

from lmplug.api import TrainingHost, TrainingTarget


class HeadTrainOptions(BaseModel):
    """Options of a trainer of a head over the target's features (EAGLE, MTP)."""

    model_config = ConfigDict(extra="forbid")

    num_prompts: int = Field(default=48, ge=2, description="instructions the model answers")
    max_tokens: int = Field(default=128, ge=8, description="tokens per answer")
    temperature: float = Field(default=0.0, ge=0, description="0: greedy answers")
    epochs: int = Field(default=4, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    cls_weight: float = Field(default=0.1, ge=0, description="weight of the token cross-entropy")
    batch_size: int = Field(default=1, ge=1, description="answers per optimizer step")
    answers: str | None = Field(default=None, description="JSON file: reuse the generated answers from it "
                                                          "if it exists, else save them there")
    max_num_seqs: int = Field(default=16, ge=1, description="answers generated at once")
    seed: int = 0
    device: str = Field(default="auto", description="auto, cpu or cuda")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="the target's dtype while it writes answers and features: train for "
                                       "the dtype you serve with; bfloat16 also runs the head's training "
                                       "matmuls under bf16 autocast (weights and optimizer stay float32)")


class EagleTrainOptions(HeadTrainOptions):
    init_from_target: bool = Field(default=False, description="start the layer from the target's last layer "
                                                              "(else random, residual branches zeroed)")
    draft_vocab: int = Field(default=8192, ge=0, description="also save the N most frequent tokens of the "
                                                             "answers as the draft vocabulary (0: none)")


@dataclass(frozen=True)
class TrainResult:
    folder: Path
    accuracy_before: float  # held-out top-1 agreement of the first draft token with the target
    accuracy_after: float


def train_eagle(host: TrainingHost, model: str, out: str, options: dict) -> TrainResult:
    opts, target = open_target(host, "eagle", EagleTrainOptions, model, options)
    answers = cached_answers(target, opts)
    data = collect(target, answers)
    n_eval = max(1, len(data) // 10)  # whole answers held out
    config = eagle_config(target.model_config)
    head = EagleHead(head_config(config), fc_bias=True, max_position=1024)
    init_head(head, target.model, opts.init_from_target)
    lm_head = head_matrix(target.model).detach().float().clone()
    before, after = fit(head, target.model.embed_tokens, lm_head, data[n_eval:], data[:n_eval], opts)
    folder = save_head(head, out, {**config, "base_model_name_or_path": model})
    if opts.draft_vocab:
        save_draft_vocab(frequent_tokens(answers, opts.draft_vocab), folder)
    print(f"saved an EAGLE head to {folder}; use it with "
          f"speculative: {{method: eagle, heads: {folder}, num_tokens: 3}}")
    return TrainResult(folder, before, after)


def cached_answers(target: TrainingTarget, opts: HeadTrainOptions) -> list[tuple[list[int], int]]:
    """Generated answers, read from / written to ``opts.answers`` when given."""
    import json

    file = Path(opts.answers) if opts.answers else None
    if file is not None and file.exists():
        return [tuple(a) for a in json.loads(file.read_text())]
    answers = generate_answers(target, opts)
    if file is not None:
        file.write_text(json.dumps(answers))
    return answers


def frequent_tokens(answers, num: int) -> torch.Tensor:
    """The ``num`` most frequent tokens of the answers (prompts included): a draft vocabulary."""
    ids = torch.tensor([t for tokens, _ in answers for t in tokens])
    values, counts = ids.unique(return_counts=True)
    return values[counts.argsort(descending=True, stable=True)[:num]].sort().values


def collect(target: TrainingTarget, answers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids [T], features [T, h]) per answer."""
    from tqdm import tqdm

    return [(torch.tensor(ids), target.hidden_states(ids).float().clone())
            for ids, _ in tqdm(answers, desc="target features", unit="answer")]


def eagle_config(cfg) -> dict:
    """A LlamaConfig (one layer) with the target's attention and MLP shapes."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
            "bias": True, "torch_dtype": "float32"}


@torch.no_grad()
def init_head(head: EagleHead, target: torch.nn.Module, from_target: bool) -> None:
    h = head.config.hidden_size
    torch.nn.init.normal_(head.fc.weight, std=0.02 / h ** 0.5)
    head.fc.weight[:, h:] += torch.eye(h)
    head.fc.bias.zero_()
    layer = head.layers[0]
    torch.nn.init.zeros_(layer.self_attn.o_proj.weight)  # both residual branches start at zero
    torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    if from_target:
        copy_last_layer(head.layers[0], target)


@torch.no_grad()
def copy_last_layer(layer: torch.nn.Module, target: torch.nn.Module) -> bool:
    """Copy the target's last decoder layer (the engine's fused projections, split back) into a
    plain Llama ``layer`` (``self_attn.{q,k,v,o}_proj``, ``mlp.*``, its norms where it has them);
    False when the target's layer cannot be read (quantized, another kind): ``layer`` keeps its
    weights."""
    last = getattr(target, "layers", [None])[-1]
    if last is None or not hasattr(last.self_attn, "qkv_proj"):
        return False
    attn, mlp = last.self_attn, last.mlp
    try:
        for name in ("q_proj", "k_proj", "v_proj"):
            a, b = attn.qkv_proj.shard_range(name)
            getattr(layer.self_attn, name).weight.copy_(attn.qkv_proj.weight[a:b])
        layer.self_attn.o_proj.weight.copy_(attn.o_proj.weight)
        for name in ("gate_proj", "up_proj"):
            a, b = mlp.gate_up_proj.shard_range(name)
            getattr(layer.mlp, name).weight.copy_(mlp.gate_up_proj.weight[a:b])
        layer.mlp.down_proj.weight.copy_(mlp.down_proj.weight)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if hasattr(layer, norm):
                getattr(layer, norm).weight.copy_(getattr(last, norm).weight)
    except (AttributeError, RuntimeError, KeyError):  # quantized or differently shaped: keep random
        return False
    return True


def fit(head: torch.nn.Module, embed: torch.nn.Module, lm_head: torch.Tensor, train, held_out,
        opts: HeadTrainOptions, label: str = "the EAGLE head") -> tuple[float, float]:
    """Train ``head`` (``forward_dense(embeds, features)``, ``draft_feature(out)``: what the
    target's ``lm_head`` reads) on (ids, features) answers; first-draft top-1 before and after."""
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(head.parameters(), lr=opts.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(opts.seed)
    before = accuracy(head, embed, lm_head, held_out)
    print(f"{sum(len(ids) - 1 for ids, _ in train)} training positions in {len(train)} answers, "
          f"{len(held_out)} answers held out; first-draft top-1 before: {before:.3f}")
    steps = opts.epochs * -(-len(train) // opts.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=opts.lr, total_steps=steps, pct_start=0.1)
    bar = tqdm(total=steps, desc=f"training {label}", unit="step")
    for epoch in range(opts.epochs):
        perm = torch.randperm(len(train), generator=gen).tolist()
        for start in range(0, len(perm), opts.batch_size):
            batch = [train[i] for i in perm[start:start + opts.batch_size]]
            with torch.autocast(lm_head.device.type, dtype=torch.bfloat16, enabled=opts.dtype == "bfloat16"):
                loss = sum(sequence_loss(head, embed, lm_head, ids, feats, opts.cls_weight)
                           for ids, feats in batch)
            loss = loss / len(batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}")
    bar.close()
    after = accuracy(head, embed, lm_head, held_out)
    print(f"first-draft top-1 after: {after:.3f}")
    return before, after


def sequence_loss(head, embed, lm_head, ids, feats, cls_weight: float) -> torch.Tensor:
    """EAGLE's loss over one answer: position t sees (token t+1, f_t) and predicts f_{t+1} (an
    MTP module: its output after its head's norm, ``draft_feature``, is what is compared)."""
    with torch.no_grad():
        embeds = embed(ids[1:]).float()
        target_probs = (feats[1:] @ lm_head.T).softmax(-1)
    pred = head.draft_feature(head.forward_dense(embeds, feats[:-1]))
    reg = F.smooth_l1_loss(pred, feats[1:])
    cls = -(target_probs * (pred @ lm_head.T).log_softmax(-1)).sum(-1).mean()
    return reg + cls_weight * cls


@torch.no_grad()
def accuracy(head, embed, lm_head, data) -> float:
    """How often the head's first draft token equals the target's next token (teacher forced)."""
    hits = total = 0
    for ids, feats in data:
        pred = head.draft_feature(head.forward_dense(embed(ids[1:]).float(), feats[:-1]))
        hits += int(((pred @ lm_head.T).argmax(-1) == (feats[1:] @ lm_head.T).argmax(-1)).sum())
        total += len(ids) - 1
    return hits / max(total, 1)
