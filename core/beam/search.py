"""One beam group's search state, step by step, as transformers' ``_beam_search`` defines it.

Every rule here follows ``GenerationMixin._beam_search`` (transformers 5): the top
``max(2, 1 + #eos) * width`` continuations over all beams, the best ``width`` of those that did not
stop become the running beams, those among the first ``width`` that did stop join the finished
hypotheses (scored ``cum_logprob / new_len ** length_penalty``), and the group ends when no
running beam can improve the finished ones (``early_stopping``: True / False / "never"), when all
hypotheses are in with ``early_stopping=True``, or when every continuation stops (max length).
Scores stay float32 tensors, as there, so ties and sums round the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_NEG = -1.0e9  # transformers' stand-in for "never chosen"


@dataclass
class Hypothesis:
    """A finished beam: its output tokens, its summed logprob and its length-penalised score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    text: str = ""  # decoded when the group ends


class BeamGroup:
    """The running beams (parent slot + new token each step) and the finished hypotheses."""

    def __init__(self, width: int, length_penalty: float, early_stopping: bool | str, max_new: int,
                 num_eos: int) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new = max_new
        self.keep = max(2, 1 + num_eos) * width
        self.outputs: list[list[int]] = [[] for _ in range(width)]  # each running beam's tokens
        self.scores = torch.full((width,), _NEG, dtype=torch.float32)
        self.scores[0] = 0.0  # all beams start equal: only the first one continues at step one
        self.done_tokens: list[list[int]] = [[] for _ in range(width)]
        self.done_cum = torch.full((width,), _NEG, dtype=torch.float32)
        self.done_scores = torch.full((width,), _NEG, dtype=torch.float32)
        self.done_mask = torch.zeros(width, dtype=torch.bool)
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied (sticky)
        self.finished = False

    def step(self, logprobs: torch.Tensor, stops: Callable[[int, int], bool]) -> list[tuple[int, int]]:
        """``logprobs``: [width, vocab] float32 log-softmax rows (masks applied), one per running beam.
        ``stops(parent, token)``: whether that continuation ends (EOS, stop token/string, length).
        Returns each new running beam's (parent beam, token); sets ``finished`` when the group ends."""
        vocab = logprobs.shape[-1]
        acc = (logprobs.float() + self.scores[:, None]).reshape(-1)
        top_lp, top_idx = torch.topk(acc, k=min(self.keep, acc.numel()))
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        new_len = len(self.outputs[0]) + 1
        hits = torch.tensor([stops(p, t) for p, t in zip(parents, tokens)], dtype=torch.bool)
        self._add_finished(top_lp, parents, tokens, hits, new_len)
        running_lp = top_lp + hits.to(torch.float32) * _NEG
        nxt = torch.topk(running_lp, k=self.width)[1].tolist()
        chosen = [(parents[k], tokens[k]) for k in nxt]
        self.outputs = [self.outputs[p] + [t] for p, t in chosen]
        self.scores = running_lp[nxt]
        self._update_improvable(new_len)
        all_in = bool(self.done_mask.all()) and self.early_stopping is True
        self.finished = not self.improvable or all_in or bool(hits.all())
        return chosen

    def _add_finished(self, top_lp: torch.Tensor, parents: list[int], tokens: list[int], hits: torch.Tensor,
                      new_len: int) -> None:
        just_done = hits.clone()
        just_done[self.width:] = False  # the rest only back up the running beams
        cand = top_lp / (new_len ** self.length_penalty)
        full = bool(self.done_mask.all()) and self.early_stopping is True
        cand = cand + float(full) * _NEG + float(not self.improvable) * _NEG
        cand = cand + (~just_done).to(torch.float32) * _NEG
        merged = torch.cat((self.done_scores, cand))
        best = torch.topk(merged, k=self.width)[1].tolist()
        all_tokens = self.done_tokens + [self.outputs[p] + [t] for p, t in zip(parents, tokens)]
        cum = torch.cat((self.done_cum, top_lp))
        mask = torch.cat((self.done_mask, just_done))
        self.done_tokens = [all_tokens[i] for i in best]
        self.done_scores, self.done_cum, self.done_mask = merged[best], cum[best], mask[best]

    def _update_improvable(self, new_len: int) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new
        else:
            length = new_len
        best_running = self.scores[0] / (length ** self.length_penalty)
        worst_done = torch.where(self.done_mask, self.done_scores.min(), torch.tensor(_NEG))
        self.improvable = self.improvable and bool((best_running > worst_done).any())

    def results(self, count: int) -> list[Hypothesis]:
        """The best ``count`` finished hypotheses, best first."""
        return [Hypothesis(self.done_tokens[i], float(self.done_cum[i]), float(self.done_scores[i]))
                for i in range(count) if bool(self.done_mask[i])]
