"""Drafters propose tokens for speculative decoding; the core's verifier accepts or rejects.

Life of a drafter in an engine:

1. built from its options (``speculative: {method: NAME, num_tokens: k, ...}``), then
   ``setup(target)`` once, after the target model is loaded: a drafter that runs a model
   (its own, or part of the target's) builds it here;
2. every step, before scheduling, ``propose(seqs, k)`` for the running decode sequences.
   Each ``seq.token_ids`` ends with the last accepted token (its K/V not yet computed).
   The engine appends the proposals tentatively, the target scores them in one forward,
   and the verifier keeps the longest acceptable prefix plus one target token
   (a drafter with ``drafts_trees`` may propose a tree, ``DraftProposal.parents``: the
   target scores it with tree attention and greedy verification follows its argmax down
   the tree, ``lmplug.speculative.tree``);
3. ``observe(seqs, hidden)`` after each step, only for drafters that set
   ``uses_hidden_states`` (heads that draft from the target's hidden states);
4. ``release(seq)`` when a sequence finishes or is aborted.

A drafter that keeps per-sequence state (a draft KV cache) must follow rejections by
itself: on the next ``propose`` the sequence's tokens may differ from what it drafted
(compare against ``seq.token_ids``; the conformance suite checks this).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field

from lmplug.interfaces.common import BackendOptions, Capabilities

if TYPE_CHECKING:
    from lmplug.interfaces.attention import AttentionBackend
    from lmplug.interfaces.kvcache import KVCacheBackend
    from lmplug.interfaces.model_config import ModelConfig
    from lmplug.interfaces.runner import ForwardRunner
    from lmplug.interfaces.sequence import Sequence
    from lmplug.interfaces.training import TrainingHost


class DrafterOptions(BackendOptions):
    """Options every drafter takes; backends subclass this for their own."""

    num_tokens: int = Field(default=4, ge=1, le=64, description="tokens proposed per step (k)")
    draft_length: Literal["fixed", "cost"] = Field(
        default="cost", description="fixed: verify every token proposed; cost: per sequence and step, verify "
                                    "the number of a chain's drafts (up to what was proposed) that maximises "
                                    "expected tokens per second of forward, from the forward times measured "
                                    "by row count and the sequence's recent acceptance "
                                    "(lmplug.speculative.draft_length)")


@dataclass(frozen=True)
class DraftModel:
    """A second model the core loaded for a drafter (``DraftTarget.open_model``), with a KV
    cache of its own, built as the engine builds one: on the target's device and dtype, sized
    for the target's ``max_model_len`` and ``max_num_seqs``."""

    model: torch.nn.Module
    model_config: ModelConfig
    kv: KVCacheBackend
    tokenizer: Any | None
    runner: ForwardRunner  # over ``model`` and ``kv``, in its own attention backend's step order


@dataclass(frozen=True)
class MTPDraft:
    """A multi-token-prediction module the core loaded for a drafter (``DraftTarget.open_mtp``):
    one module of the checkpoint (DeepSeek-V3 / GLM-4.5 layers after the last decoder layer,
    Qwen3-Next's ``mtp.*``), its decoder layer of the target's architecture, with a one-layer
    cache of the target's KV class.

    ``module(input_ids, features, ctx) -> hidden`` [T, h]: at each position of a context the
    runner built, the module's output from the pair (token t+1, the target's final normed hidden
    state at t); ``module.compute_logits(hidden) -> logits`` through its head's norm and the
    shared (or its own) output head. ``lmplug.kit.mtp`` has the equations and layouts."""

    module: torch.nn.Module
    kv: KVCacheBackend  # one layer, the target's KV class and layout, no prefix caching
    runner: ForwardRunner  # over ``module`` and ``kv``: ``build_context``
    num_modules: int  # modules the checkpoint holds
    source: str  # the checkpoint or folder it came from


@dataclass(frozen=True)
class DraftTarget:
    """What a drafter may use of the engine it serves, handed to ``Drafter.setup``.

    ``model`` is the target ``torch.nn.Module`` (``forward(input_ids, positions, ctx) ->
    hidden``, ``compute_logits(hidden)``); ``kv`` the target's KV backend (a drafter reads it,
    e.g. block tables, but must not write into it); ``attention`` the target's attention
    backend instance (a drafter with attention layers of its own may build one of its class
    and options, so it reads the caches ``new_kv_cache`` makes).

    What the core builds for a drafter:

    - ``open_model(name_or_path) -> DraftModel``: load another model (cache name, HF folder,
      GGUF) with a KV cache of its own;
    - ``new_runner(model, kv) -> ForwardRunner``: the engine's model runner over ``model``
      bound to ``kv`` (``build_context`` / ``execute``);
    - ``new_kv_cache(num_layers, **spec) -> KVCacheBackend``: a fresh cache of the target's KV
      class and options for ``num_layers`` layers, without prefix caching (a draft's cached
      blocks may hold tokens the target later rejects); ``spec`` overrides other
      ``KVCacheSpec`` fields (e.g. a draft head's ``num_kv_heads``, ``head_dim``);
    - ``open_mtp(path, module) -> MTPDraft``: module ``module`` of the multi-token-prediction
      weights in the target's checkpoint (``path`` None) or in a folder ``path`` (written by
      ``lmplug train-drafter --method mtp``); ``ConfigError`` when there are none. None where
      a caller built the target by hand without it.
    """

    model: torch.nn.Module
    model_config: ModelConfig
    kv: KVCacheBackend
    tokenizer: Any | None
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    attention: AttentionBackend
    open_model: Callable[[str], DraftModel]
    new_runner: Callable[[torch.nn.Module, KVCacheBackend], ForwardRunner]
    new_kv_cache: Callable[..., KVCacheBackend]
    open_mtp: Callable[[str | None, int], MTPDraft] | None = None


@dataclass
class DraftProposal:
    """Per sequence, up to ``k`` proposed tokens and, when they were sampled, the draft
    distributions they were drawn from (``probs[i]``: ``[len(token_ids[i]), vocab]``).

    ``probs=None`` (or a ``None`` entry) means the proposal is a deterministic function of
    the sequence (n-gram lookup, greedy drafting): the verifier treats each draft
    distribution as a point mass on the proposed token, which keeps sampling exact.
    """

    token_ids: list[list[int]]
    probs: list[torch.Tensor | None] | None = None
    # tree candidates (greedy requests only): parents[i][j] is the index of sequence i's draft j's
    # parent among its drafts, -1 for the root (the last accepted token); drafts are in
    # topological order (parents[i][j] < j). None (or a None entry): a chain, as without it.
    # Only drafters whose ``drafts_trees`` is True may return trees; the engine cuts a tree of a
    # sampling request to the chain of first children (node 0's path), so sampling stays exact
    parents: list[list[int] | None] | None = None

    def probs_of(self, i: int) -> torch.Tensor | None:
        return None if self.probs is None else self.probs[i]

    def parents_of(self, i: int) -> list[int] | None:
        return None if self.parents is None else self.parents[i]


class Drafter(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = DrafterOptions
    # True: the engine calls ``observe`` after every step with the target's hidden states
    uses_hidden_states: ClassVar[bool] = False

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @property
    def drafts_trees(self) -> bool:
        """True when this drafter, as configured, proposes trees (``DraftProposal.parents``): the
        engine then needs an attention backend with the "tree_attention" feature."""
        return False

    def setup(self, target: DraftTarget) -> None:
        """Called once at build time with the target; drafters that run a model build it here."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: int) -> DraftProposal:
        """Propose up to ``num_tokens`` next tokens for each sequence (fewer, or none, is fine).

        A sampling drafter draws with ``seq.generator`` after applying the request's
        temperature / top-k / top-p / min-p (``lmplug.kit.sampling.processed_logits``)
        and returns those distributions in ``probs``.
        """

    def kv_moved(self, seq: Sequence, src: list[int], dst: list[int]) -> None:
        """After a draft tree's verification the engine moved the target's K/V of the accepted
        path from positions ``src`` to ``dst`` (``lmplug.speculative.tree.move_kv``); a drafter that keeps
        something per target KV slot (EAGLE's features) moves it the same way."""

    def observe(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """With ``uses_hidden_states``: after each step, for every sequence that got tokens, the
        target's final (normed) hidden state [B, h] at its last computed position, the one
        whose logits chose its last token ``seq.token_ids[-1]`` (Medusa drafts from it; EAGLE needs
        the features of *every* position and records them itself, see
        ``lmplug_speculative.feature_store``).
        """

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted: drop whatever is kept for it."""

    @classmethod
    def train(cls, host: TrainingHost, model: str, out: str, options: dict) -> None:
        """Train this drafter's weights for ``model`` and save them under ``out`` in the
        format its options load (``lmplug train-drafter --method NAME MODEL OUT``); ``host``
        (``lmplug.interfaces.training``) opens the target and runs it."""
        raise NotImplementedError(f"drafter {cls.name!r} has nothing to train")
