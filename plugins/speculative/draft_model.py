"""Model drafters: ``draft_model`` (a second, smaller model) and ``layer_skip`` (the target's
own first layers). Both run through ``DraftRunner`` with a KV cache of their own.

- ``draft_model``: any model lmplug loads (cache name, HF folder, GGUF) with the target's
  tokenizer, on the target's device and dtype. Option ``model``.
- ``layer_skip``: self-speculation (LayerSkip, Draft & Verify): the target's embedding,
  its first ``num_layers`` decoder layers, its final norm and its head. No extra weights;
  the draft's K/V for those layers lives in a second, smaller cache of the target's KV
  class (so the target's attention backend reads it).
"""

from __future__ import annotations

import dataclasses

import torch
from lmplug_speculative.draft_runner import DraftRunner
from pydantic import Field

from lmplug.api import Capabilities, Drafter, DrafterOptions, DraftProposal, DraftTarget
from lmplug.errors import ConfigError

_TOKENIZER_PROBE = "Speculative decoding, 2 models: def f(x):\n    return x * 42  # ok?"


class _ModelDrafter(Drafter):
    """Shared by the model drafters: ``setup`` builds ``self.runner``."""

    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    runner: DraftRunner | None = None

    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        if self.runner is None:
            raise RuntimeError(f"drafter {self.name!r}: setup(target) was not called")
        return self.runner.propose(seqs, num_tokens)

    def release(self, seq) -> None:
        if self.runner is not None:
            self.runner.release(seq)


class DraftModelOptions(DrafterOptions):
    model: str = Field(description="the draft model: a cache name, HF folder or .gguf file "
                                   "with the target's tokenizer")


class DraftModelDrafter(_ModelDrafter):
    name = "draft_model"
    Options = DraftModelOptions

    def setup(self, target: DraftTarget) -> None:
        draft = target.open_model(self.options.model)
        check_tokenizers(target.tokenizer, draft.tokenizer, self.options.model)
        self.runner = DraftRunner(draft.runner, draft.kv, target.model_config.vocab_size)


def check_tokenizers(target, draft, draft_name: str) -> None:
    """Refuse a draft model whose tokenizer encodes text differently from the target's."""
    if target is None or draft is None:
        return
    if target.encode(_TOKENIZER_PROBE) != draft.encode(_TOKENIZER_PROBE):
        raise ConfigError(f"speculative: draft_model: model {draft_name!r} tokenizes text differently "
                          f"from the target model; a draft model must share the target's tokenizer")


class LayerSkipOptions(DrafterOptions):
    num_layers: int | None = Field(default=None, ge=1,
                                   description="decoder layers the draft runs (default: half the target's)")


class LayerSkipDrafter(_ModelDrafter):
    name = "layer_skip"
    Options = LayerSkipOptions

    def setup(self, target: DraftTarget) -> None:
        total = target.model_config.num_layers
        n = self.options.num_layers or max(1, total // 2)
        if n >= total:
            raise ConfigError(f"speculative: layer_skip: num_layers={n} must be below the target's "
                              f"{total} layers (allowed: 1..{total - 1})")
        model = EarlyExitModel(target.model, n)
        kv = target.new_kv_cache(n)
        self.runner = DraftRunner(target.new_runner(model, kv), kv, target.model_config.vocab_size)


class EarlyExitModel(torch.nn.Module):
    """The target's first ``num_layers`` layers, then its final norm and head (shared weights)."""

    def __init__(self, target: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        missing = [a for a in ("embed_tokens", "layers", "norm", "rope", "compute_logits")
                   if not hasattr(target, a)]
        if missing:
            raise ConfigError(f"speculative: layer_skip: the target model {type(target).__name__} has no "
                              f"{', '.join(missing)}; layer_skip needs a decoder-only model")
        self._target = [target]  # a list: not a submodule, the weights stay the target's
        self.config = dataclasses.replace(target.config, num_layers=num_layers)
        self.kv_views: list = []

    def bind_kv(self, views: list) -> None:
        self.kv_views = views

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        target = self._target[0]
        x = target.embed_tokens(input_ids)  # [T, h]
        if hasattr(target, "run_layers"):  # the kit's decoder: the native step where the step fits
            return target.norm(target.run_layers(x, positions, ctx, self.kv_views, self.config.num_layers))
        for layer, kv in zip(target.layers, self.kv_views):  # kv_views has num_layers entries
            x = layer(x, positions, target.rope, kv, ctx)
        return target.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

