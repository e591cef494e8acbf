"""First-party acceptance rules (``speculative: {..., acceptance: {rule: NAME, ...}}``).

- ``exact`` (the default): speculative sampling; the output follows the target exactly.
- ``typical`` (lossy): Medusa's typical acceptance.
- ``cascade`` (lossy): speculative cascades, the drafter's distribution where a deferral rule
  trusts it, the target's elsewhere.
- ``route`` (lossy): token-level cascade routing, the baseline ``cascade`` is measured against.

Every rule keeps the greedy default (``AcceptanceRule.accept_greedy``: the longest prefix equal
to the argmax), as Medusa does at temperature 0: the lossy rules act on sampled requests. None
of them emits a token the shaped target rules out (p = 0: the structured-output mask, top-k /
top-p / min-p), so constraints hold under every rule.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from lmplug.api import LOSSY, AcceptanceOptions, AcceptanceRule, Capabilities, Decision
from lmplug.kit.sampling import draw, point_mass, rejection_sample

_DEVICES = frozenset({"cpu", "cuda"})


class ExactRule(AcceptanceRule):
    """Speculative sampling (``rejection_sample`` towards p): every token follows the target."""

    name = "exact"
    capabilities = Capabilities(devices=_DEVICES)
    lossy = False

    def accept(self, p, q, draft, generator) -> Decision:
        return rejection_sample(p, q, draft, generator)

    def emitted_distribution(self, p_row, q_row, token=None) -> torch.Tensor:
        return p_row


class TypicalOptions(AcceptanceOptions):
    posterior_threshold: float = Field(
        default=0.09, gt=0, le=1, description="epsilon: a draft token is accepted when the target gives it "
        "more than min(epsilon, delta * exp(-H(p)))")
    posterior_alpha: float = Field(
        default=0.3, ge=0, le=1, description="delta in that threshold (Medusa's `posterior_alpha`; its paper "
        "suggests delta = sqrt(epsilon))")


class TypicalRule(AcceptanceRule):
    """Typical acceptance (Cai et al. 2024, "Medusa", section 2.3.1; ``evaluate_posterior`` in
    its code): draft token x_j is accepted when

        p_j(x_j) > min(epsilon, delta * exp(-H(p_j))),   H(p) = -sum_v p(v) log p(v)

    with p_j the target's shaped distribution at that position (epsilon ``posterior_threshold``,
    delta ``posterior_alpha``; Medusa's defaults 0.09 and 0.3 = sqrt(0.09)). The first rejected
    position (or the bonus after all k) emits a draw from the target's p there, so the first
    token of a step is the target's own draw whenever the first draft is rejected. Entropy is
    exact (0 log 0 = 0; Medusa's code adds 1e-5 inside the log). Lossy: accepted drafts follow
    q restricted to the tokens the threshold admits."""

    name = "typical"
    capabilities = Capabilities(devices=_DEVICES, features=frozenset({LOSSY}))
    Options = TypicalOptions

    def thresholds(self, p: torch.Tensor) -> torch.Tensor:
        """[rows]: min(epsilon, delta * exp(-H(p_row))) for each row of p."""
        entropy = -torch.special.xlogy(p, p).sum(-1)
        opts = self.options
        return torch.clamp(opts.posterior_alpha * torch.exp(-entropy), max=opts.posterior_threshold)

    def accept(self, p, q, draft, generator) -> Decision:
        k = len(draft)
        if k:
            ids = torch.tensor(draft, dtype=torch.long)
            ok = (p[torch.arange(k), ids] > self.thresholds(p[:k])).tolist()
            m = ok.index(False) if False in ok else k
        else:
            m = 0
        return Decision(m, list(draft[:m]) + [draw(p[m], generator)])

    def emitted_distribution(self, p_row, q_row, token=None) -> torch.Tensor:
        if q_row is None:
            q_row = point_mass(token, p_row.shape[-1], p_row.dtype)
        admitted = p_row > self.thresholds(p_row.unsqueeze(0))[0]
        kept = q_row.to(p_row.dtype) * admitted
        return kept + (1 - kept.sum()) * p_row


class CascadeOptions(AcceptanceOptions):
    deferral: Literal["opt", "chow", "diff"] = Field(
        default="opt", description="when to defer to the target at a position: opt: max q < max p - "
        "alpha * TV(p, q); chow: max q < 1 - alpha; diff: max q < max p - alpha")
    alpha: float = Field(default=0.1, ge=0, le=10, description="the deferral threshold (chow and diff: at most 1); "
                         "larger trusts the drafter more (0 with chow or opt: the target almost everywhere)")

    @field_validator("alpha")
    @classmethod
    def _alpha_in_range(cls, value: float, info: ValidationInfo) -> float:
        if info.data.get("deferral") in ("chow", "diff") and value > 1:
            raise ValueError(f"with deferral {info.data['deferral']!r} alpha must be in [0, 1]")
        return value


class CascadeRule(AcceptanceRule):
    """Speculative cascades (Narasimhan et al., "Faster Cascades via Speculative Decoding",
    ICLR 2025, arXiv:2405.19261): at each drafted position a deferral rule r in {0, 1} compares
    the drafter's distribution q with the target's p, and speculative sampling runs towards the
    mixture

        pi = (1 - r) * q~ + r * p        instead of p,

    i.e. a draft x is accepted with probability min(1, pi(x) / q(x)) and the first rejection
    draws from norm(max(0, pi - q)); so every emitted token follows pi exactly
    (``rejection_sample``'s identity holds for any target). The deferral rules (the paper's):

    - ``opt`` (its plug-in approximation of the optimal rule): r = 1 iff
      max q < max p - alpha * TV(p, q), TV(p, q) = 1/2 sum |p - q|;
    - ``chow``: r = 1 iff max q < 1 - alpha (the drafter's own confidence);
    - ``diff``: r = 1 iff max q < max p - alpha.

    q~ is q restricted to the target's support (renormalised), so a token the shaped target
    rules out (structured-output mask, filters) is never emitted; where q has no mass there,
    or without a draft distribution (``q`` None: the drafter's confidence is unknown), the rule
    defers (pi = p). The bonus token after k acceptances follows p (no q there)."""

    name = "cascade"
    capabilities = Capabilities(devices=_DEVICES, features=frozenset({LOSSY}))
    Options = CascadeOptions

    def defers(self, p_row: torch.Tensor, q_row: torch.Tensor) -> bool:
        alpha, rule = self.options.alpha, self.options.deferral
        top_q = float(q_row.max())
        if rule == "chow":
            return top_q < 1 - alpha
        top_p = float(p_row.max())
        if rule == "diff":
            return top_q < top_p - alpha
        return top_q < top_p - alpha * 0.5 * float((p_row - q_row).abs().sum())

    def mixture(self, p_row: torch.Tensor, q_row: torch.Tensor | None) -> torch.Tensor:
        """pi for one position: q restricted to supp(p) where the rule keeps the drafter, else p."""
        if q_row is None:
            return p_row
        kept = q_row.to(p_row.dtype) * (p_row > 0)
        mass = float(kept.sum())
        if mass <= 0:
            return p_row
        kept = kept / mass
        return p_row if self.defers(p_row, kept) else kept

    def accept(self, p, q, draft, generator) -> Decision:
        k = len(draft)
        if q is None:  # no confidence to trust: the target everywhere, i.e. exact
            return rejection_sample(p, None, draft, generator)
        target = torch.stack([self.mixture(p[j], q[j]) for j in range(k)] + [p[k]])
        return rejection_sample(target, q, draft, generator)

    def emitted_distribution(self, p_row, q_row, token=None) -> torch.Tensor:
        return self.mixture(p_row, q_row)


class RouteOptions(AcceptanceOptions):
    threshold: float = Field(default=0.8, gt=0, le=1,
                             description="the drafter answers a position when its top probability (max q) "
                             "is at least this; the target answers the first position below it")


class RouteRule(AcceptanceRule):
    """Token-level cascade routing (the cascade of a small and a large model, no speculation as
    such; the baseline speculative cascades are compared with): the drafter answers while it is
    confident, max q >= ``threshold`` (Chow's rule on the drafter alone, p never consulted),
    and the target answers the first position where it is not, with a draw from p there, which
    ends the step. A draft the shaped target rules out (p = 0) is not accepted either. Without a
    draft distribution (``q`` None) confidence is unknown and the target answers.

    The target still runs one forward per step over the drafted positions and computes the KV
    of every token, so the saving is in target forwards per token, as for speculation."""

    name = "route"
    capabilities = Capabilities(devices=_DEVICES, features=frozenset({LOSSY}))
    Options = RouteOptions

    def confident(self, q_row: torch.Tensor | None) -> bool:
        return q_row is not None and float(q_row.max()) >= self.options.threshold

    def accept(self, p, q, draft, generator) -> Decision:
        m = 0
        while m < len(draft) and self.confident(None if q is None else q[m]) and float(p[m, draft[m]]) > 0:
            m += 1
        return Decision(m, list(draft[:m]) + [draw(p[m], generator)])

    def emitted_distribution(self, p_row, q_row, token=None) -> torch.Tensor:
        if not self.confident(q_row):
            return p_row
        kept = q_row.to(p_row.dtype) * (p_row > 0)
        return kept + (1 - kept.sum()) * p_row
