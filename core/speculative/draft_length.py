"""How many of a chain's proposed drafts to verify, step by step (``draft_length: cost``).

A verify of ``k`` drafts is a forward of ``k + 1`` rows per sequence. On a GPU that costs
about what one row costs, so every proposed draft is worth verifying. On a CPU the products
turn compute-bound after a few rows (the demo model, one thread: 3 rows 1.25 decode steps,
5 rows 1.5-1.8), so a draft that is likely rejected costs more than it is expected to
return. This controller chooses, for each sequence and step, the number of drafts ``k`` (up
to what the drafter proposed) that maximises

    expected tokens emitted / cost of the step's forward
    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 a_2 ... a_k
           (a_j: the chance that draft j is accepted once drafts 1 .. j - 1 were)

with three estimates kept as the engine runs:

- ``cost(rows)``: the wall time of the step's forward by its number of rows (an exponential
  moving average of the forwards the speculator times, decode and verify steps alone). A row
  count not yet seen is assumed to cost one row's time plus ``OPTIMISM`` of it per extra
  row, so it gets tried once and then measured (optimism in the face of uncertainty);
- the drafter's time per draft token asked for (its ``propose`` timed, a moving average):
  before drafting, the number of tokens to ask for is chosen with it added to the cost (a
  drafter that runs a model, ``layer_skip`` or ``draft_model``, costs a large part of a
  forward per token; ``ngram`` next to nothing); when no sequence's drafts would pay, the
  drafter is not asked at all and the step decodes plainly. Once drafted, the tokens are
  cut without it (it is spent);
- ``a_j`` per sequence and draft position: of its recent verifies that judged draft j (drafts
  1 .. j - 1 accepted), the share that accepted it. Counts are decayed by ``DECAY`` per verify
  so that they follow the text (long copied spans, then free text); ``a_1`` has a prior of one
  accept and one reject, and ``a_j`` of ``PRIOR_WEIGHT`` judgements at ``a_(j-1)``'s rate (with
  no data, one rate for every position). A step that verifies nothing decays the counts too,
  so a sequence whose drafts stopped paying is tried again after a few steps. Positions are
  not alike: a draft that follows accepted ones is far likelier to be accepted than the first
  (the demo model, ngram drafts of 4, ``bench_speculative.py``'s prompts once each, counted by
  a throwaway hook on the speculator: on the copy
  prompts 0.70 of first drafts accepted, then 0.93, 0.95, 0.94; on free text 0.56, then 0.83,
  0.93, 0.85), so one rate for all would cut long drafts that pay.

With several sequences in a step, each one's choice counts the rows the others already have
(one each, plus the drafts chosen before it), each as one token emitted. Trees are not cut (their nodes are not in
order of likelihood the way a chain's are).
"""

from __future__ import annotations

OPTIMISM = 0.1  # assumed cost of an extra row, as a share of a one-row forward, until measured
DECAY = 0.8  # per verify (or plain step) weight of a sequence's earlier acceptance counts
SMOOTHING = 0.3  # weight of a new forward time in its row count's moving average
PRIOR_WEIGHT = 1.0  # judgements at the position before's rate that a position's estimate starts from


class DraftLength:
    def __init__(self) -> None:
        self.cost: dict[int, float] = {}  # rows of a forward -> seconds (moving average)
        self.draft_token_cost: float | None = None  # seconds of drafting per token asked for
        # seq_id -> per draft position j (index j - 1): [accepted, judged], decayed
        self._counts: dict[int, list[list[float]]] = {}

    # -- what the engine saw ---------------------------------------------------------------------
    def observe_forward(self, rows: int, seconds: float) -> None:
        old = self.cost.get(rows)
        self.cost[rows] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """The drafter's ``propose`` took ``seconds`` for ``tokens`` tokens a sequence."""
        if tokens <= 0:
            return
        per, old = seconds / tokens, self.draft_token_cost
        self.draft_token_cost = per if old is None else old + SMOOTHING * (per - old)

    def observe_verify(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` chain drafts that accepted the first ``accepted`` (0 drafted:
        a plain step): positions 1 .. accepted accepted, the next one (if drafted) rejected."""
        counts = self._counts.setdefault(seq_id, [])
        for pair in counts:
            pair[0] *= DECAY
            pair[1] *= DECAY
        judged = min(drafted, accepted + 1)
        while len(counts) < judged:
            counts.append([0.0, 0.0])
        for j in range(judged):
            counts[j][1] += 1.0
            counts[j][0] += 1.0 if j < accepted else 0.0

    def release(self, seq_id: int) -> None:
        self._counts.pop(seq_id, None)

    # -- the choice ------------------------------------------------------------------------------
    def acceptance(self, seq_id: int, depth: int) -> list[float]:
        """``[a_1, ..., a_depth]``: the chance of each draft position's acceptance given the ones
        before it were accepted (module docstring)."""
        counts = self._counts.get(seq_id, [])
        rates, prior = [], None
        for j in range(depth):
            acc, judged = counts[j] if j < len(counts) else (0.0, 0.0)
            rate = (acc + 1.0) / (judged + 2.0) if prior is None else \
                (acc + PRIOR_WEIGHT * prior) / (judged + PRIOR_WEIGHT)
            rates.append(rate)
            prior = rate
        return rates

    def forward_cost(self, rows: int) -> float | None:
        """Seconds of a forward of ``rows`` rows: measured, or assumed from the nearest
        measured row count below it (OPTIMISM of one row's cost a row), or below every
        measured count by the same rule backwards; None before any forward was timed."""
        if rows in self.cost:
            return self.cost[rows]
        if not self.cost:
            return None
        below = [r for r in self.cost if r < rows]
        if not below:
            base = min(self.cost)
            return self.cost[base] / (1 + OPTIMISM * (base - 1)) * (1 + OPTIMISM * (rows - 1))
        base = max(below)
        one = self.cost.get(1, self.cost[base] / (1 + OPTIMISM * (base - 1)))
        return self.cost[base] + OPTIMISM * one * (rows - base)

    def choose(self, seq_id: int, proposed: int, other_rows: int, drafting: bool = False) -> int:
        """Drafts to verify, 0 .. ``proposed``, for a sequence whose step has ``other_rows``
        rows besides its own (each counted as one token the step emits); ``drafting``: before
        the drafter runs, its time per token counted too."""
        if proposed <= 0:
            return 0
        per_draft = self.draft_token_cost if drafting and self.draft_token_cost is not None else 0.0
        rates = self.acceptance(seq_id, proposed)
        best, best_rate = proposed, -1.0
        expected, reach = float(other_rows), 1.0  # reach: the chance that draft k is accepted
        for k in range(proposed + 1):
            if k:
                reach *= rates[k - 1]
            expected += reach
            cost = self.forward_cost(other_rows + k + 1)
            if cost is None:  # nothing timed yet: verify what was proposed
                return proposed
            rate = expected / (cost + k * per_draft)
            if rate > best_rate:
                best, best_rate = k, rate
        return best
