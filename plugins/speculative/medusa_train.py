"""Train Medusa heads for any model on text the model generates itself (self-distillation).

    lmplug train-drafter --method medusa MODEL OUT [-o num_heads=3 -o epochs=2 ...]

1. The target answers a set of built-in instructions (its chat template, greedy by
   default): the heads learn to predict *this model's* continuations.
2. One prefill forward per answer gives the target's final hidden state at every
   position t of the answer; head i's label is the token at t + i + 2.
3. The heads' residual blocks are trained with cross-entropy (head i weighted 0.8^i, as
   in Medusa-1); their output matrices are the target's ``lm_head``, frozen, so a CPU
   trains them in minutes and the drafter shares one matrix multiply at run time.
4. Saved in the FasterDecoding format (``medusa_lm_head.safetensors`` + ``config.json``).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from lmplug_speculative.head_matrix import head_matrix
from lmplug_speculative.medusa_heads import MedusaHeads, save_heads
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmplug.api import SamplingParams, TrainingHost, TrainingTarget
from lmplug.errors import ConfigError

TASKS = ["Write a short story about {}.", "Explain {} in simple terms.", "Give five tips about {}.",
         "Write a Python function that has something to do with {}.", "Describe {} in one paragraph.",
         "What are the pros and cons of {}?", "Summarize what people should know about {}.",
         "Write a short poem about {}."]
TOPICS = ["the ocean", "coffee", "machine learning", "a city at night", "gardening", "space travel",
          "chess", "bicycles", "the moon", "friendship", "volcanoes", "music", "cooking pasta", "rain",
          "trains", "sorting lists", "databases", "birds", "the history of writing", "exercise",
          "mountains", "the internet", "dogs", "learning a language", "bread", "electric cars", "deserts",
          "photography", "sleep", "ancient Rome", "recycling", "robots", "winter", "museums", "honey bees",
          "time management", "rivers", "video games", "the human heart", "paper airplanes", "tea",
          "forests", "solar power", "libraries", "airplanes", "dinosaurs", "public speaking", "snow",
          "basketball", "spreadsheets", "islands", "clocks", "the stock market", "penguins", "painting",
          "hiking", "recursion", "cats", "the weather", "bridges"]
TASKS += ["Write a letter to a friend about {}.", "List the main facts about {}.",
          "Write a dialogue between two people talking about {}.", "Teach a beginner about {} step by step."]


class MedusaTrainOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_heads: int = Field(default=3, ge=1, le=8)
    num_layers: int = Field(default=1, ge=1, le=4, description="residual blocks per head")
    num_prompts: int = Field(default=48, ge=2, description="instructions the model answers")
    max_tokens: int = Field(default=128, ge=8, description="tokens per answer")
    temperature: float = Field(default=0.0, ge=0, description="0: greedy answers")
    epochs: int = Field(default=4, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    batch_size: int = Field(default=64, ge=1)
    max_num_seqs: int = Field(default=16, ge=1, description="answers generated at once")
    seed: int = 0
    device: str = Field(default="auto", description="auto, cpu or cuda")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="the target's dtype while it writes answers and features: "
                                       "train for the dtype you serve with")


@dataclass(frozen=True)
class TrainResult:
    folder: Path
    accuracy_before: list[float]  # held-out top-1 per head, before and after training
    accuracy_after: list[float]


def open_target(host: TrainingHost, method: str, options_cls, model: str,
                options: dict) -> tuple[BaseModel, TrainingTarget]:
    """Validated training options and the target model (``opts.dtype``, continuous batching), seeded."""
    try:
        opts = options_cls(**options)
    except ValidationError as exc:
        raise ConfigError(f"train-drafter {method}: invalid options: {exc}") from None
    torch.manual_seed(opts.seed)
    target = host.open_target(model, device=opts.device, dtype=opts.dtype, max_model_len=1024,
                              max_num_seqs=opts.max_num_seqs)
    return opts, target


def train_medusa(host: TrainingHost, model: str, out: str, options: dict) -> TrainResult:
    opts, target = open_target(host, "medusa", MedusaTrainOptions, model, options)
    answers = generate_answers(target, opts)
    n_eval = max(1, len(answers) // 10)  # whole answers held out: neighbouring positions leak
    train = collect_features(target, answers[n_eval:], opts.num_heads)
    held_out = collect_features(target, answers[:n_eval], opts.num_heads)
    lm_head = head_matrix(target.model).detach().float()
    heads = MedusaHeads(lm_head.shape[1], lm_head.shape[0], opts.num_heads, opts.num_layers)
    heads.to(lm_head.device)
    before, after = fit(heads, lm_head, train, held_out, opts)
    with torch.no_grad():
        for weight in heads.head_weights():
            weight.copy_(lm_head)
    folder = save_heads(heads, out, extra_config={"base_model_name_or_path": model, "hidden_size": lm_head.shape[1],
                                      "vocab_size": lm_head.shape[0]})
    print(f"saved {opts.num_heads} Medusa heads to {folder}; use them with "
          f"speculative: {{method: medusa, heads: {folder}, num_tokens: {opts.num_heads}}}")
    return TrainResult(folder, before, after)


def instructions(num: int, seed: int) -> list[str]:
    pairs = list(itertools.product(TASKS, TOPICS))
    random.Random(seed).shuffle(pairs)
    return [task.format(topic) for task, topic in pairs[:num]]


def generate_answers(target: TrainingTarget, opts: MedusaTrainOptions) -> list[tuple[list[int], int]]:
    """(prompt + answer token ids, prompt length) per instruction (in the model's chat template),
    generated together (continuous batching), with a progress bar."""
    from tqdm import tqdm

    prompts = [target.chat_prompt(text) for text in instructions(opts.num_prompts, opts.seed)]
    params = [SamplingParams(temperature=opts.temperature, max_tokens=opts.max_tokens, seed=opts.seed + i)
              for i in range(len(prompts))]
    with tqdm(total=len(prompts) * opts.max_tokens, desc="generating answers", unit="tok") as bar:
        answers = target.generate(prompts, params, bar.update)
    return [(prompt + answer, len(prompt)) for prompt, answer in zip(prompts, answers)]


def collect_features(target: TrainingTarget, answers, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [N, h] at every answer position t and labels [N, num_heads]: the tokens at
    t + i + 2 (-100 past the end)."""
    from tqdm import tqdm

    feats, labels = [], []
    for ids, prompt_len in tqdm(answers, desc="target hidden states", unit="answer"):
        hidden = target.hidden_states(ids)  # [T, h]
        tokens = torch.tensor(ids + [-100] * (num_heads + 1))
        positions = torch.arange(prompt_len - 1, len(ids) - 2)
        feats.append(hidden[positions])
        labels.append(torch.stack([tokens[positions + i + 2] for i in range(num_heads)], dim=1))
    return torch.cat(feats).float(), torch.cat(labels)


def fit(heads: MedusaHeads, lm_head: torch.Tensor, train: tuple[torch.Tensor, torch.Tensor],
        held_out: tuple[torch.Tensor, torch.Tensor], opts: MedusaTrainOptions) -> tuple[list[float], list[float]]:
    """Train the residual blocks on (features, labels) (the output matrix stays the target's
    lm_head); returns the held-out top-1 accuracy per head before and after."""
    from tqdm import tqdm

    features, labels = train
    gen = torch.Generator().manual_seed(opts.seed)
    blocks = [p for name, p in heads.named_parameters() if ".linear." in name]
    for p in heads.parameters():
        p.requires_grad_(False)
    for p in blocks:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(blocks, lr=opts.lr, weight_decay=0.0)
    weights = torch.tensor([0.8 ** i for i in range(len(heads))])
    before = _accuracy(heads, lm_head, *held_out)
    print(f"{len(features)} training positions, {len(held_out[0])} held out; top-1 per head before: {before}")
    for epoch in range(opts.epochs):
        perm = torch.randperm(len(features), generator=gen)
        bar = tqdm(perm.split(opts.batch_size), desc=f"epoch {epoch + 1}/{opts.epochs}", unit="batch")
        for idx in bar:
            loss = _loss(heads, lm_head, features[idx], labels[idx], weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    after = _accuracy(heads, lm_head, *held_out)
    print(f"top-1 per head after: {after}")
    return before, after


def _loss(heads, lm_head, x, y, weights) -> torch.Tensor:
    logits = heads.blocks(x, len(heads)) @ lm_head.T  # [heads, B, V]
    per_head = torch.stack([F.cross_entropy(logits[i], y[:, i], ignore_index=-100)
                            for i in range(len(heads))])
    return (weights * per_head.nan_to_num()).sum()


@torch.no_grad()
def _accuracy(heads, lm_head, x, y) -> list[float]:
    pred = (heads.blocks(x, len(heads)) @ lm_head.T).argmax(-1)  # [heads, B]
    out = []
    for i in range(len(heads)):
        valid = y[:, i] != -100
        out.append(round(float((pred[i][valid] == y[valid, i]).float().mean()), 3))
    return out
