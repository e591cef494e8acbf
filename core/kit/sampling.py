"""Turn the last position's logits into next tokens, per sequence params; logprobs on request.

``sample`` first adjusts the logits (``lmplug.kit.penalties``: penalties, logit_bias,
min_tokens, the structured-output bitmask); then greedy rows take the argmax and sampled rows
go through ``processed_logits``, whose order matches HF transformers: temperature, top-k,
top-p, min-p. Sampling draws with each sequence's own ``torch.Generator`` (the
exponential-race form of multinomial sampling: ``argmax(p / E)`` with
``E ~ Exp(1)``), so a seeded request gives the same tokens whatever else is
in the batch. The rejection-sampling math of speculative decoding (``rejection_sample``) draws
with the same ``draw``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from lmplug.interfaces.acceptance import Decision
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Logprob, Sequence
from lmplug.kit.penalties import NO_HISTORY, PromptIds, RowHistory, adjust_logits


def apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p / min-p exclude. logits [N, V]; params [N]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches p (always the first token)
    mass_before = probs.cumsum(-1) - probs
    # (rows with top_p == 1 skip it: in float32 the cumulative sum can pass 1.0 before the tail)
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # min-p: drop tokens below min_p x the top token's probability
    probs = sorted_logits.softmax(-1)
    drop = probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def processed_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p, row by row: logits [N, V] -> [N, V] float32.

    Greedy rows (temperature 0) are left at temperature 1; callers take their argmax.
    The speculative verifier and sampling drafters use this too, so the target and the
    draft distributions are shaped by the same rules.
    """
    logits = logits.float()
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    scaled = logits / temps.unsqueeze(1)
    if any(p.needs_filtering for p in params):
        dev = logits.device
        scaled = apply_filters(
            scaled,
            torch.tensor([max(p.top_k, 0) for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            torch.tensor([p.min_p for p in params], device=dev))
    return scaled


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int] = frozenset(),
           bitmask: torch.Tensor | None = None, bitmask_rows: torch.Tensor | list[int] | None = None,
           prompts: PromptIds | None = None) -> list[int]:
    """logits [N, V] (one row per sequence) -> next token id per sequence.

    ``eos_token_ids`` (the model's) are what ``min_tokens`` blocks besides each request's stop
    ids; ``bitmask`` / ``bitmask_rows`` are the structured-output masks (``adjust_logits``);
    ``prompts`` (the caller's, kept across steps) caches the penalised sequences' prompts.
    Every row is shaped before any is drawn, so a batch that raises has moved no generator."""
    logits = logits.float()
    if bitmask is not None or any(s.params.needs_adjusting for s in seqs):
        histories = [NO_HISTORY if not s.params.needs_adjusting
                     else RowHistory(s.prompt_token_ids, s.output_token_ids) if prompts is None
                     else prompts.history(s, s.output_token_ids) for s in seqs]
        logits = adjust_logits(logits, [s.params for s in seqs], histories, eos_token_ids, bitmask, bitmask_rows)
    if all(s.params.is_greedy for s in seqs):
        return greedy(logits)
    probs = processed_logits(logits, [s.params for s in seqs]).softmax(-1)
    out = []
    for i, seq in enumerate(seqs):
        if seq.params.is_greedy:
            out.append(int(logits[i].argmax()))
            continue
        out.append(draw(probs[i], seq.generator))
    return out


def greedy(logits: torch.Tensor) -> list[int]:
    """The first largest entry of each row of ``logits`` [N, V] (torch's ``argmax``: NaN counts as
    largest). On the CPU through numpy, whose argmax over one row is vectorised: a 49k
    vocabulary takes 6 us there, 47 us in torch's."""
    if logits.is_cpu and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution ``probs`` [V] (need not be normalised):
    ``argmax(p / E)`` with ``E ~ Exp(1)`` picks token i with probability p_i / sum(p)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int,
                 decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """For each row: the chosen token's logprob and rank plus the top-k (raw model distribution).

    logits [N, V], chosen [N] -> one dict per row. With ``decode`` (token id -> its text) each
    entry's ``decoded_token`` is filled; without it, it is None.
    """
    logprobs = logits.float().log_softmax(-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(-1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    rows = []
    for i in range(logits.shape[0]):
        entry = {int(chosen[i]): Logprob(float(chosen_lp[i]), int(ranks[i]))}
        if k > 0:
            for r, (tid, val) in enumerate(zip(top_ids[i].tolist(), top_vals[i].tolist()), start=1):
                entry.setdefault(tid, Logprob(val, r))
        rows.append(entry if decode is None else with_text(entry, decode))
    return rows


def with_text(row: dict[int, Logprob], decode: Callable[[int], str]) -> dict[int, Logprob]:
    """``row`` with each entry's ``decoded_token`` set to its token's text."""
    return {tid: replace(lp, decoded_token=decode(tid)) for tid, lp in row.items()}


def rejection_sample(target: torch.Tensor, q: torch.Tensor | None, draft: list[int],
                     generator: torch.Generator | None) -> Decision:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023) towards ``target``
    [k+1, V], for drafts drawn from ``q`` [k, V] (None: point masses on the drafts).

    Draft x ~ q is accepted with probability min(1, t(x) / q(x)); at the first rejection the
    emitted token is drawn from the residual norm(max(0, t - q)) and the rest is dropped. Then
    P(emit x) = q(x) min(1, t/q) + (1 - sum_y min(t, q)) max(0, t - q)(x) / sum_y max(0, t - q)
    = min(t, q)(x) + max(0, t - q)(x) = t(x), since sum_y max(0, t - q) = 1 - sum_y min(t, q):
    every emitted token is an exact sample of ``target``'s row; after k acceptances the bonus
    token is drawn from ``target[k]``. Any target works (a cascade passes its mixture)."""
    k = len(draft)
    if k == 0:
        return Decision(0, [draw(target[0], generator)])
    rows = torch.arange(k)
    ids = torch.tensor(draft, dtype=torch.long)
    t_draft = target[rows, ids]
    q_draft = torch.ones(k, dtype=target.dtype) if q is None else q[rows, ids].to(target.dtype)
    u = torch.rand(k, generator=generator, dtype=target.dtype)
    # u < t/q without dividing (q may be 0 for a token the drafter could not have drawn)
    rejected = (u * q_draft >= t_draft).tolist()
    m = rejected.index(True) if True in rejected else k
    if m == k:
        return Decision(k, list(draft) + [draw(target[k], generator)])
    q_row = point_mass(draft[m], target.shape[-1], target.dtype) if q is None else q[m].to(target.dtype)
    return Decision(m, list(draft[:m]) + [draw(residual_distribution(target[m], q_row), generator)])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised (``draw`` normalises); falls back to p if it vanishes."""
    residual = (p - q).clamp_(min=0)
    return residual if float(residual.sum()) > 0 else p


def point_mass(token: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(vocab, dtype=dtype)
    out[token] = 1
    return out
