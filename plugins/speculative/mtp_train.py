"""Train a multi-token-prediction module for a model that ships none.

    lmplug train-drafter --method mtp MODEL OUT [-o epochs=4 -o num_prompts=48 ...]

The same pipeline as the EAGLE trainer (``eagle_train.py``): the target answers built-in
instructions, one prefill forward per answer gives its features f_t (final hidden state after
the final norm), and the module learns, at position t from (token t+1, f_t), the target's
next-position feature and distribution: smooth-L1 between ``shared_head.norm(out_t)`` and
f_{t+1}, plus ``cls_weight`` x the cross-entropy of softmax(lm_head(f_{t+1})) under
lm_head(shared_head.norm(out_t)). The embedding and the ``lm_head`` are the target's, frozen.

The decoder layer starts as a copy of the target's last layer (``init_from_target``, the
default; else random with its residual branches zeroed), ``eh_proj`` as "pass the normed
feature through" plus small random weights on the embedding half, the head's norm as the
target's final norm. Saved in DeepSeek-V3's layout (``mtp_head.save_mtp``), which
``speculative: {method: mtp, path: OUT}`` loads.
"""

from __future__ import annotations

import torch
from lmplug_speculative.eagle_train import (
    HeadTrainOptions,
    TrainResult,
    cached_answers,
    collect,
    copy_last_layer,
    fit,
)
from lmplug_speculative.head_matrix import head_matrix
from lmplug_speculative.medusa_train import open_target
from lmplug_speculative.mtp_head import MTPHead, save_mtp
from pydantic import Field

from lmplug.api import TrainingHost


class MTPTrainOptions(HeadTrainOptions):
    init_from_target: bool = Field(default=True, description="start the decoder layer from the target's last "
                                                             "layer (else random, residual branches zeroed)")
    cls_weight: float = Field(default=1.0, ge=0, description="weight of the token cross-entropy")


def train_mtp(host: TrainingHost, model: str, out: str, options: dict) -> TrainResult:
    opts, target = open_target(host, "mtp", MTPTrainOptions, model, options)
    answers = cached_answers(target, opts)
    data = collect(target, answers)
    n_eval = max(1, len(data) // 10)  # whole answers held out
    head = MTPHead(target.model_config, max_position=1024)
    init_mtp(head, target.model, opts.init_from_target)
    lm_head = head_matrix(target.model).detach().float().clone()
    before, after = fit(head, target.model.embed_tokens, lm_head, data[n_eval:], data[:n_eval], opts,
                        label="the MTP module")
    folder = save_mtp(head, out, model)
    print(f"saved an MTP module to {folder}; use it with speculative: {{method: mtp, path: {folder}, num_tokens: 2}}")
    return TrainResult(folder, before, after)


@torch.no_grad()
def init_mtp(head: MTPHead, target: torch.nn.Module, from_target: bool) -> None:
    h = head.config.hidden_size
    torch.nn.init.normal_(head.eh_proj.weight, std=0.02 / h ** 0.5)
    head.eh_proj.weight[:, h:] += torch.eye(h)
    norm = getattr(target, "norm", None)
    if norm is not None and tuple(norm.weight.shape) == (h,):
        head.shared_head.norm.weight.copy_(norm.weight)
    if from_target and copy_last_layer(head, target):
        return
    torch.nn.init.zeros_(head.self_attn.o_proj.weight)  # both residual branches start at zero
    torch.nn.init.zeros_(head.mlp.down_proj.weight)
