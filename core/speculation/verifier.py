"""The speculative verifier: accept draft tokens so that the output keeps the target's distribution.

The target scores a sequence's last accepted token plus its ``k`` draft tokens in one
forward, giving ``k + 1`` rows of logits: row ``j`` is the target's next-token
distribution after draft token ``j`` (row 0: after the last accepted token). The verifier
returns the accepted drafts followed by exactly one token from the target: the
correction at the first rejection, or the *bonus* token from row ``k`` when all ``k``
were accepted. So every verification emits between 1 and ``k + 1`` tokens.

- Greedy (temperature 0): accept draft ``j`` while it equals the target's argmax.
- Sampling: speculative sampling (Leviathan et al., 2023; Chen et al., 2023), exact for
  any draft distribution ``q``; see ``verify_sampling``. Temperature, top-k, top-p and
  min-p shape the target distribution ``p`` here (``processed_logits``) and the draft's
  in the drafter, by the same rules.

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

from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.penalties import NO_HISTORY, RowHistory, adjust_logits
from lmplug.interfaces.sampling import draw, processed_logits
from lmplug.speculation.tree import verify_tree_greedy


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted drafts, then one target token (correction or bonus)
    num_accepted: int
    # a tree (``lmplug.speculation.tree``): the accepted nodes, root to leaf; None for a chain (drafts 0..m-1)
    nodes: list[int] | None = None

    @property
    def rows(self) -> list[int]:
        """The logits row (of this sequence's rows) that chose each emitted token."""
        if self.nodes is None:
            return list(range(len(self.tokens)))
        return [0] + [j + 1 for j in self.nodes]


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> Verdict:
    """logits [k+1, V]: accept the longest prefix of ``draft`` equal to the target's argmax."""
    best = logits.argmax(-1).tolist()
    m = 0
    while m < len(draft) and draft[m] == best[m]:
        m += 1
    return Verdict(draft[:m] + [best[m]], m)


def verify_sampling(p: torch.Tensor, q: torch.Tensor | None, draft: list[int],
                    generator: torch.Generator | None) -> Verdict:
    """Speculative sampling. p [k+1, V] target probabilities, q [k, V] draft probabilities
    (None: each draft token was chosen deterministically, i.e. q is a point mass on it).

    Accept rule: draft token x ~ q is accepted with probability min(1, p(x) / q(x)); at the
    first rejection the emitted token is drawn from the residual norm(max(0, p - q)) and the
    rest of the draft is dropped. Then P(emit x) = q(x) min(1, p/q) + (1 - sum_y min(p, q))
    * max(0, p(x) - q(x)) / sum_y max(0, p - q) = min(p, q)(x) + max(0, p - q)(x) = p(x),
    because sum_y max(0, p - q) = 1 - sum_y min(p, q). Each emitted token is therefore an
    exact sample from the target; after k acceptances the bonus token is drawn from p[k].
    """
    k = len(draft)
    if k == 0:
        return Verdict([draw(p[0], generator)], 0)
    rows = torch.arange(k)
    ids = torch.tensor(draft, dtype=torch.long)
    p_draft = p[rows, ids]
    q_draft = torch.ones(k) if q is None else q[rows, ids].to(p.dtype)
    u = torch.rand(k, generator=generator, dtype=p.dtype)
    # u < p/q without dividing (q may be 0 for a token the drafter could not have drawn)
    rejected = (u * q_draft >= p_draft).tolist()
    m = rejected.index(True) if True in rejected else k
    if m == k:
        return Verdict(list(draft) + [draw(p[k], generator)], k)
    q_row = point_mass(draft[m], p.shape[-1], p.dtype) if q is None else q[m].to(p.dtype)
    return Verdict(list(draft[:m]) + [draw(residual_distribution(p[m], q_row), generator)], m)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised (``draw`` normalises); falls back to p if it vanishes."""
    residual = (p - q).clamp_(min=0)
    return residual if float(residual.sum()) > 0 else p


def point_mass(token: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(vocab, dtype=dtype)
    out[token] = 1
    return out


def verify_batch(logits: torch.Tensor, num_rows: list[int], params: list[SamplingParams],
                 drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                 generators: list[torch.Generator | None],
                 parents: list[list[int] | None] | None = None,
                 histories: list[RowHistory] | None = None, eos_token_ids: frozenset[int] = frozenset(),
                 bitmask: torch.Tensor | None = None,
                 bitmask_rows: torch.Tensor | list[int] | None = None) -> list[Verdict]:
    """Verify a batch: sequence i owns ``num_rows[i] == len(drafts[i]) + 1`` consecutive rows
    of ``logits`` [sum(num_rows), V]. Acceptance lengths differ per sequence.

    ``parents[i]`` (greedy sequences only) makes sequence i's drafts a tree
    (``tree.verify_tree_greedy``); None entries are chains. ``histories`` has one ``RowHistory``
    per logits row (required when any params need adjusting); ``eos_token_ids``, ``bitmask`` and
    ``bitmask_rows`` (indices into the logits rows) are as in ``penalties.adjust_logits``."""
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
        elif sp.is_greedy:
            verdicts.append(verify_greedy(logits[start:start + n], draft))
        else:
            verdicts.append(verify_sampling(probs[start:start + n], q, draft, gen))
        start += n
    return verdicts
