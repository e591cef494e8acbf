"""Distill a DFlash block-diffusion head for any model on text the model generates itself.

    lmplug train-drafter --method dflash MODEL OUT [-o block_size=8 -o epochs=4 ...]

The pipeline of the EAGLE trainer (``eagle_train.py``): the target answers built-in instructions;
one prefill forward per answer gives, through forward hooks, the outputs of its layers
``target_layer_ids`` (the last layer's after the final norm, as transformers' hidden states)
and its final hidden states f_t. Per answer and epoch, ``anchors`` random positions a each make
one training block: the context is positions < a, the block [token a, mask × (block_size - 1)]
at a..a+block_size-1, and row j learns the target's distribution of the token at a + j,
softmax(lm_head(f_{a+j-1})) (a soft cross-entropy). The embedding and the ``lm_head`` are the
target's, frozen. Saved as transformers' ``muse_glimmer_assistant`` (``config.json`` +
``model.safetensors``), which ``speculative: {method: dflash, heads: OUT}`` loads.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from lmplug_speculative.dflash_head import MODEL_TYPE, WEIGHTS, DFlashHead, read_config
from lmplug_speculative.eagle_train import HeadTrainOptions, TrainResult, cached_answers
from lmplug_speculative.head_matrix import head_matrix
from lmplug_speculative.medusa_train import open_target
from pydantic import Field

from lmplug.api import TrainingHost, TrainingTarget


class DFlashTrainOptions(HeadTrainOptions):
    block_size: int = Field(default=8, ge=2, le=64, description="the block: an anchor and block_size - 1 drafts")
    num_layers: int = Field(default=1, ge=1, le=8, description="the head's decoder layers")
    target_layer_ids: list[int] | None = Field(default=None, description="the target layers whose outputs "
                                                                         "the head reads (default: up to 5 "
                                                                         "spread over the model)")
    mask_token_id: int | None = Field(default=None, ge=0, description="the token id of a masked position "
                                                                     "(default: the vocabulary's last)")
    anchors: int = Field(default=16, ge=1, description="training blocks per answer and epoch")
    lr: float = Field(default=3e-3, gt=0)


def train_dflash(host: TrainingHost, model: str, out: str, options: dict) -> TrainResult:
    opts, target = open_target(host, "dflash", DFlashTrainOptions, model, options)
    cfg = target.model_config
    config = dflash_config(cfg, opts, len(target.model.layers))
    head = DFlashHead(read_config(config, "dflash_train"), max_position=1024)
    answers = cached_answers(target, opts)
    data = collect(target, answers, head.config.target_layer_ids)
    n_eval = max(1, len(data) // 10)  # whole answers held out
    lm_head = head_matrix(target.model).detach().float().clone()
    mask = target.model.embed_tokens(torch.tensor([head.config.mask_token_id])).detach().float().clone()
    before, after = fit(head, target.model.embed_tokens, mask, lm_head, data[n_eval:], data[:n_eval], opts)
    folder = save(head, out, {**config, "base_model_name_or_path": model})
    print(f"saved a DFlash head to {folder}; use it with speculative: {{method: dflash, heads: {folder}}}")
    return TrainResult(folder, before, after)


def dflash_config(cfg, opts: DFlashTrainOptions, num_target_layers: int) -> dict:
    """transformers' ``MuseGlimmerAssistantConfig`` fields with the target's attention and MLP shapes."""
    n = min(5, num_target_layers)
    ids = opts.target_layer_ids or sorted({round(i * (num_target_layers - 1) / max(n - 1, 1)) for i in range(n)})
    return {"architectures": ["MuseGlimmerAssistantModel"], "model_type": MODEL_TYPE,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": opts.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "max_position_embeddings": cfg.max_position_embeddings, "sliding_window": 2048,
            "layer_types": ["full_attention"] * opts.num_layers, "hidden_act": "silu",
            "block_size": opts.block_size, "target_layer_ids": ids,
            "mask_token_id": cfg.vocab_size - 1 if opts.mask_token_id is None else opts.mask_token_id,
            "dtype": "float32"}


def collect(target: TrainingTarget, answers, layer_ids) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(token ids [T], the layers' outputs concatenated [T, n h], final hidden states [T, h]) per answer."""
    from tqdm import tqdm

    model = target.model
    if hasattr(model, "allow_native_step"):
        model.allow_native_step(False)
    last, taken = len(model.layers) - 1, {}
    handles = [model.layers[i].register_forward_hook(functools.partial(lambda i, m, a, o: taken.__setitem__(i, o), i))
               for i in set(layer_ids) if i != last]
    try:
        data = []
        for ids, _ in tqdm(answers, desc="target hidden states", unit="answer"):
            final = target.hidden_states(ids).float().clone()
            layers = torch.cat([final if i == last else taken[i].float().clone() for i in layer_ids], -1)
            data.append((torch.tensor(ids), layers, final))
        return data
    finally:
        for handle in handles:
            handle.remove()


def block_logits(head: DFlashHead, embed, mask: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor,
                 layers: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits [A, block_size - 1, V] of the blocks anchored at ``anchors`` [A] of one answer,
    each over the context before its anchor (the engine's computation, dense)."""
    size, t = head.config.block_size, len(ids)
    positions = torch.arange(t)
    past = [(k.expand(len(anchors), *k.shape), v.expand(len(anchors), *v.shape))
            for k, v in head.context_kv(head.project(layers), positions)]
    with torch.no_grad():
        first = embed(ids[anchors]).float()
    embeds = torch.cat([first[:, None], mask.expand(len(anchors), size - 1, -1)], 1)
    block = anchors[:, None] + torch.arange(size)
    out = head(embeds, block, past, positions.expand(len(anchors), t), positions[None] < anchors[:, None])
    return out[:, 1:] @ lm_head.T


def blocks_loss(head, embed, mask, lm_head, ids, layers, final, anchors) -> tuple[torch.Tensor, int, int]:
    """Soft cross-entropy of each block row against the target's distribution of its token, and
    (first-draft hits, blocks): whether row 1's argmax is the target's."""
    size, t = head.config.block_size, len(ids)
    logits = block_logits(head, embed, mask, lm_head, ids, layers, anchors)
    at = anchors[:, None] + torch.arange(1, size)  # the positions the rows draft
    inside = at < t
    with torch.no_grad():
        target = (final[(at - 1).clamp(max=t - 1)] @ lm_head.T).softmax(-1)
    loss = -(target * logits.log_softmax(-1)).sum(-1)[inside].mean()
    hits = int((logits[:, 0].argmax(-1) == target[:, 0].argmax(-1)).sum())
    return loss, hits, len(anchors)


def fit(head, embed, mask, lm_head, train, held_out, opts: DFlashTrainOptions) -> tuple[float, float]:
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(head.parameters(), lr=opts.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(opts.seed)
    before = accuracy(head, embed, mask, lm_head, held_out)
    print(f"{len(train)} answers, {len(held_out)} held out; first-draft top-1 before: {before:.3f}")
    steps = opts.epochs * -(-len(train) // opts.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=opts.lr, total_steps=steps, pct_start=0.1)
    bar = tqdm(total=steps, desc="training the DFlash head", unit="step")
    for _ in range(opts.epochs):
        perm = torch.randperm(len(train), generator=gen).tolist()
        for start in range(0, len(perm), opts.batch_size):
            loss = 0.0
            for i in perm[start:start + opts.batch_size]:
                ids, layers, final = train[i]
                anchors = torch.randint(1, len(ids) - 1, (opts.anchors,), generator=gen)
                loss = loss + blocks_loss(head, embed, mask, lm_head, ids, layers, final, anchors)[0]
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    after = accuracy(head, embed, mask, lm_head, held_out)
    print(f"first-draft top-1 after: {after:.3f}")
    return before, after


@torch.no_grad()
def accuracy(head, embed, mask, lm_head, data) -> float:
    """How often the first draft of a block equals the target's next token, over every anchor."""
    hits = total = 0
    for ids, layers, final in data:
        h, n = blocks_loss(head, embed, mask, lm_head, ids, layers, final, torch.arange(1, len(ids) - 1))[1:]
        hits, total = hits + h, total + n
    return hits / max(total, 1)


def save(head: DFlashHead, folder: str | Path, config: dict) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in head.state_dict().items()}, str(folder / WEIGHTS))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
