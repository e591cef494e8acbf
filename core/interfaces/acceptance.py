"""Acceptance rules: how a speculative step decides which draft tokens to keep (the ``acceptance``
family, chosen inside the speculative section: ``speculative: {method: ..., acceptance: {rule:
typical, posterior_threshold: 0.09}}``; absent: exact rejection sampling).

The verifier (``lmplug.speculative.verifier``) hands a rule one sequence's chain:

- ``p`` [k+1, V]: the target's next-token probabilities after the last accepted token and after
  each draft token, shaped exactly as plain sampling shapes them (penalties, ``logit_bias``,
  ``min_tokens``, the structured-output mask, temperature, top-k / top-p / min-p);
- ``q`` [k, V]: the drafter's distributions the drafts were drawn from, or None when each draft
  token was a deterministic choice (n-gram lookup, greedy drafting);
- the ``k`` draft tokens and the sequence's ``torch.Generator`` (every random draw uses it, so
  a seeded request decodes the same whatever else shares the batch).

It returns a ``Decision``: how many drafts it keeps (always a prefix) and the tokens emitted,
those drafts followed by exactly one token of the rule's own choosing (at the first rejected
position, or the bonus from ``p[k]`` after all ``k``). Greedy requests go to
``accept_greedy(logits, draft)``, by default the longest prefix equal to the argmax.

A rule states what it emits: ``emitted_distribution(p_row, q_row, token)`` is the law of the
token emitted at a drafted position the chain reaches (the draft drawn from ``q_row``, or, with
``q_row`` None, the deterministic ``token``). ``lossy = False`` promises that law is ``p_row``
(speculative sampling, Leviathan et al. 2023, is the one such rule here); a lossy rule trades
that for longer accepted runs, is never the default, lists the "lossy" feature in its
capabilities (``lmplug plugins`` shows it), and is refused for requests that ask for the
target distribution exactly (``SamplingParams.exact``, ``check_exact_request``). The
conformance suite (``lmplug.testing.AcceptanceConformance``) draws from every rule and checks
its tokens against its declared law by chi-square, and a lossless rule's law against ``p``.

The primitives speculative sampling needs (``rejection_sample``, ``residual_distribution``,
``point_mass``: ``lmplug.kit.sampling``; ``greedy_prefix``, the base class's default, here)
live in one place so the core's default and rules that build on them (a cascade's mixture target) share one implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import torch

from lmplug.errors import ConfigError
from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.params import SamplingParams

LOSSY = "lossy"  # the capabilities feature every lossy rule lists


class Decision(NamedTuple):
    """One chain's verdict: ``tokens[:num_accepted]`` are the accepted drafts, then one more."""

    num_accepted: int
    tokens: list[int]


class AcceptanceOptions(BackendOptions):
    """Options every acceptance rule takes (none); rules subclass this for their own."""


class AcceptanceRule(ABC):
    """Decide a speculative chain's verdict from the target's and the drafter's distributions."""

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options: ClassVar[type[AcceptanceOptions]] = AcceptanceOptions
    # True unless the rule proves its tokens follow p exactly (then list no "lossy" feature)
    lossy: ClassVar[bool] = True

    def __init__(self, options: AcceptanceOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def accept(self, p: torch.Tensor, q: torch.Tensor | None, draft: list[int],
               generator: torch.Generator | None) -> Decision:
        """A sampled request's chain: p [k+1, V], q [k, V] or None, ``len(draft) == k``."""

    @abstractmethod
    def emitted_distribution(self, p_row: torch.Tensor, q_row: torch.Tensor | None,
                             token: int | None = None) -> torch.Tensor:
        """[V]: the law of the token this rule emits at a drafted position the chain reaches, the
        draft there drawn from ``q_row`` (None: the deterministic draft ``token``)."""

    def accept_greedy(self, logits: torch.Tensor, draft: list[int]) -> Decision:
        """A greedy request's chain (logits [k+1, V], adjusted, not tempered): by default the
        longest prefix of ``draft`` equal to the argmax, then the argmax."""
        return greedy_prefix(logits, draft)


def greedy_prefix(logits: torch.Tensor, draft: list[int]) -> Decision:
    """Accept the longest prefix of ``draft`` equal to the argmax of each row; emit the argmax
    at the first disagreement (or after the last draft)."""
    best = logits.argmax(-1).tolist()
    m = 0
    while m < len(draft) and draft[m] == best[m]:
        m += 1
    return Decision(m, list(draft[:m]) + [best[m]])


def check_exact_request(params: SamplingParams, rule: AcceptanceRule | None) -> None:
    """Refuse a request that asks for the target distribution exactly (``SamplingParams.exact``)
    when the engine verifies drafts with a lossy rule. None: no rule configured (exact)."""
    if params.exact and rule is not None and rule.lossy:
        raise ConfigError(
            f"SamplingParams.exact=True asks for the target distribution exactly, but this engine "
            f"verifies drafts with the lossy acceptance rule {rule.name!r} (speculative.acceptance); "
            "serve it with `acceptance: exact` (the default) or drop `exact`")
