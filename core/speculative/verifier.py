"""The speculative verifier: accept draft tokens by the engine's acceptance rule (default: exact).

The target scores a sequence's last accepted token plus its ``k`` draft tokens in one
forward, giving ``k + 1`` rows of logits: row ``j`` is the target's next-token
distribution after draft token ``j`` (row 0: after the last accepted token). The verifier
returns the accepted drafts followed by exactly one token from the target: the
correction at the first rejection, or the *bonus* token from row ``k`` when all ``k``
were accepted. So every verification emits between 1 and ``k + 1`` tokens.

- Greedy (temperature 0): accept draft ``j`` while it equals the target's argmax
  (``AcceptanceRule.accept_greedy``; every first-party rule keeps this).
- Sampling: the acceptance rule (``lmplug.interfaces.acceptance``) decides from the shaped
  target distribution ``p`` and the draft's ``q``; without one (the default), speculative
  sampling (Leviathan et al., 2023; Chen et al., 2023), exact for any draft distribution
  ``q``; see ``verify_sampling``. Temperature, top-k, top-p and min-p shape ``p`` here
  (``processed_logits``) and the draft's in the drafter, by the same rules. A lossy rule
  (typical acceptance, speculative cascades, routing) trades exactness for longer runs.

Penalties, logit_bias, min_tokens and the structured-output bitmask adjust every row first
(``penalties.adjust_logits``, row ``j`` seeing the output plus ``draft[:j]``), so greedy
verification takes the adjusted argmax and speculative sampling targets the adjusted ``p``:
the output keeps exactly the distribution plain decoding with the same adjustments has.

Draft trees (greedy requests only) are verified by ``tree.verify_tree_greedy``; their
``Verdict.nodes`` name the accepted path, ``Verdict.rows`` the logits row of each token.

Every sequence draws from its own ``torch.Generator``, so a seeded request decodes the
same whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmplug.interfaces.acceptance import AcceptanceRule, Decision, greedy_prefix
from lmplug.interfaces.params import SamplingParams
from lmplug.kit.penalties import NO_HISTORY, RowHistory, adjust_logits
from lmplug.kit.sampling import (
    point_mass,
    processed_logits,
    rejection_sample,
    residual_distribution,
)
from lmplug.speculative.tree import verify_tree_greedy

# (``point_mass`` and ``residual_distribution`` stay importable from here)
__all__ = ["Verdict", "point_mass", "residual_distribution", "verify_batch", "verify_greedy", "verify_sampling"]


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted drafts, then one target token (correction or bonus)
    num_accepted: int
    # a tree (``lmplug.speculative.tree``): the accepted nodes, root to leaf; None for a chain (drafts 0..m-1)
    nodes: list[int] | None = None

    @property
    def rows(self) -> list[int]:
        """The logits row (of this sequence's rows) that chose each emitted token."""
        if self.nodes is None:
            return list(range(len(self.tokens)))
        return [0] + [j + 1 for j in self.nodes]


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> Verdict:
    """logits [k+1, V]: accept the longest prefix of ``draft`` equal to the target's argmax."""
    m, tokens = greedy_prefix(logits, draft)
    return Verdict(tokens, m)


def verify_sampling(p: torch.Tensor, q: torch.Tensor | None, draft: list[int],
                    generator: torch.Generator | None) -> Verdict:
    """Speculative sampling (``acceptance.rejection_sample`` towards p): p [k+1, V] target
    probabilities, q [k, V] draft probabilities (None: point masses on the drafts). Every
    emitted token is an exact sample from the target."""
    m, tokens = rejection_sample(p, q, draft, generator)
    return Verdict(tokens, m)


def checked_verdict(decision: Decision, draft: list[int], rule: AcceptanceRule) -> Verdict:
    """A rule's decision as a ``Verdict``, refused unless it keeps a prefix of the draft and
    emits exactly one token past it (a broken third-party rule fails here, not in the KV rollback)."""
    m, tokens = decision
    if not (0 <= m <= len(draft) and len(tokens) == m + 1 and list(tokens[:m]) == list(draft[:m])):
        raise RuntimeError(f"verifier: acceptance rule {rule.name!r} returned {decision!r} for draft {draft}: "
                           "expected the accepted prefix of the draft, then one token")
    return Verdict(list(tokens), m)


def verify_batch(logits: torch.Tensor, num_rows: list[int], params: list[SamplingParams],
                 drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                 generators: list[torch.Generator | None],
                 parents: list[list[int] | None] | None = None,
                 histories: list[RowHistory] | None = None, eos_token_ids: frozenset[int] = frozenset(),
                 bitmask: torch.Tensor | None = None,
                 bitmask_rows: torch.Tensor | list[int] | None = None,
                 rule: AcceptanceRule | None = None) -> list[Verdict]:
    """Verify a batch: sequence i owns ``num_rows[i] == len(drafts[i]) + 1`` consecutive rows
    of ``logits`` [sum(num_rows), V]. Acceptance lengths differ per sequence.

    ``parents[i]`` (greedy sequences only) makes sequence i's drafts a tree
    (``tree.verify_tree_greedy``); None entries are chains. ``histories`` has one ``RowHistory``
    per logits row (required when any params need adjusting); ``eos_token_ids``, ``bitmask`` and
    ``bitmask_rows`` (indices into the logits rows) are as in ``penalties.adjust_logits``.
    ``rule`` decides each chain (None: exact speculative sampling, greedy prefix matching)."""
    logits = logits.float()
    row_params = [p for p, n in zip(params, num_rows) for _ in range(n)]
    if bitmask is not None or any(p.needs_adjusting for p in params):
        if histories is None:
            if any(p.needs_adjusting for p in params):
                raise ValueError("verifier: penalties, logit_bias or min_tokens need one RowHistory per logits row")
            histories = [NO_HISTORY] * len(row_params)
        logits = adjust_logits(logits, row_params, histories, eos_token_ids, bitmask, bitmask_rows)
    probs = None
    if not all(p.is_greedy for p in params):
        probs = processed_logits(logits, row_params).softmax(-1)
    verdicts, start = [], 0
    for n, sp, draft, q, gen in zip(num_rows, params, drafts, draft_probs, generators):
        if len(draft) != n - 1:
            raise ValueError(f"verifier: {len(draft)} draft tokens need {len(draft) + 1} logits rows, got {n}")
        tree = None if parents is None else parents[len(verdicts)]
        if tree is not None:
            if not sp.is_greedy:
                raise ValueError("verifier: draft trees are verified for greedy requests only")
            v = verify_tree_greedy(logits[start:start + n], draft, tree)
            verdicts.append(Verdict(v.tokens, len(v.nodes), v.nodes))
        elif rule is not None:
            rows = slice(start, start + n)
            decision = rule.accept_greedy(logits[rows], draft) if sp.is_greedy else \
                rule.accept(probs[rows], q, draft, gen)
            verdicts.append(checked_verdict(decision, draft, rule))
        elif sp.is_greedy:
            verdicts.append(verify_greedy(logits[start:start + n], draft))
        else:
            verdicts.append(verify_sampling(probs[start:start + n], q, draft, gen))
        start += n
    return verdicts
