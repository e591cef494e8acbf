"""``mtp``: draft with a multi-token-prediction module (DeepSeek-V3, GLM-4.5, Qwen3-Next layouts).

The module comes from the target's checkpoint, or from a folder ``path`` written by
``lmplug train-drafter --method mtp MODEL OUT`` for a model that ships none (``mtp_train.py``).
The core loads it (``DraftTarget.open_mtp``: its decoder layer is one of the target's
architecture, its KV a one-layer cache of the target's class; ``lmplug.kit.mtp`` has the
equations); this drafter runs it exactly as the EAGLE drafter runs a head: per target sequence a
mirror whose position t holds the pair (target feature t, token t+1), caught up with the target's
real features each step, then chained on its own outputs for drafts 2..k (DeepSeek-V3's single
module reused at every depth, as vLLM and SGLang do). Trees (``tree_width``, ``dynamic_tree``)
work as with EAGLE.
"""

from __future__ import annotations

import torch
from lmplug_speculative.eagle import EagleDrafter, FeatureDraftOptions
from pydantic import Field

from lmplug.api import Capabilities, DraftTarget
from lmplug.errors import ConfigError


class MTPOptions(FeatureDraftOptions):
    path: str | None = Field(default=None, description="folder of MTP weights written by `lmplug train-drafter "
                                                       "--method mtp`; empty: the target checkpoint's own")
    module: int = Field(default=0, ge=0, description="which of the checkpoint's MTP modules drafts (all k "
                                                     "tokens: it is chained on its own output)")


class MTPDrafter(EagleDrafter):
    name = "mtp"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options = MTPOptions

    def _open_head(self, target: DraftTarget) -> None:
        if target.open_mtp is None:
            raise ConfigError("speculative: mtp: this target cannot load multi-token-prediction modules")
        draft = target.open_mtp(self.options.path, self.options.module)
        self.mtp = draft.module
        self.source = draft.source
        self.kv, self.runner = draft.kv, draft.runner
        self._compute_logits = draft.module.compute_logits
        self._vocab_ids = None

    @classmethod
    def train(cls, host, model: str, out: str, options: dict) -> None:
        from lmplug_speculative.mtp_train import train_mtp

        train_mtp(host, model, out, options)

    def _compute(self, input_ids: torch.Tensor, features: torch.Tensor, ctx) -> torch.Tensor:
        return self.mtp(input_ids, features, ctx)
