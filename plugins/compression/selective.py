"""``selective``: Selective Context (Li et al., 2023, "Compressing Context to Enhance Inference
Efficiency of Large Language Models", EMNLP 2023).

Each unprotected segment is scored once by the scorer; the self-information of a token is
``-log p(token | text before it)`` and a unit's (a phrase ending at punctuation or a line break, or
a sentence) is the sum over its tokens (the paper's lexical-unit merge). Units go lowest
self-information first until the unprotected text has ``rate`` of its target tokens. To land on the
budget, the last unit to go may lose only its final words (its head stays).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Literal

from lmplug_compression.units import assemble, phrases, sentences, words
from pydantic import Field

from lmplug.api import (
    CompressionInput,
    CompressionResult,
    Compressor,
    CompressorOptions,
    Scorer,
    fit_drop,
)


class SelectiveOptions(CompressorOptions):
    unit: Literal["phrase", "sentence"] = Field(default="phrase", description="what is kept or dropped whole: "
                                                "clauses ending at punctuation, or sentences")
    reduce: Literal["sum", "mean"] = Field(default="sum", description="a unit's self-information from its "
                                           "tokens': the sum (the paper) or the mean")


def unit_scores(text: str, units: list[str], starts: list[int], nll: list[float], reduce: str) -> list[float]:
    """Each unit's self-information from the tokens that start inside it (``starts``: the
    tokens' character offsets in ``text``)."""
    ends = list(accumulate(len(u) for u in units))
    totals, counts = [0.0] * len(units), [0] * len(units)
    u = 0
    for start, value in zip(starts, nll):
        while u < len(units) - 1 and start >= ends[u]:
            u += 1
        totals[u] += value
        counts[u] += 1
    if reduce == "mean":
        return [t / c if c else 0.0 for t, c in zip(totals, counts)]
    return totals


def token_starts(pieces: list[str]) -> list[int]:
    return [0, *accumulate(len(p) for p in pieces)][:-1] if pieces else []


class Selective(Compressor):
    name = "selective"
    Options = SelectiveOptions
    needs_scorer = True

    def compress(self, request: CompressionInput, scorer: Scorer | None) -> CompressionResult:
        if scorer is None:
            raise ValueError("selective needs a scorer")
        split = phrases if self.options.unit == "phrase" else sentences
        todo = [i for i, s in enumerate(request.segments) if not s.protected and s.text]
        tokenized = {i: scorer.pieces(request.segments[i].text) for i in todo}
        logprobs = dict(zip(todo, scorer.token_logprobs_batch([tokenized[i][0] for i in todo])))
        ranked: list[tuple[float, int, int]] = []  # (score, segment, unit)
        unit_words: dict[tuple[int, int], list[int]] = {}  # (segment, unit) -> its word indices
        pieces: list[list[str]] = [[] for _ in request.segments]
        for i in todo:
            text = request.segments[i].text
            units = split(text)
            nll = [-lp for lp in logprobs[i]]
            scores = unit_scores(text, units, token_starts(tokenized[i][1]), nll, self.options.reduce)
            for u, (unit, score) in enumerate(zip(units, scores)):
                ws = words(unit)
                unit_words[i, u] = list(range(len(pieces[i]), len(pieces[i]) + len(ws)))
                pieces[i].extend(ws)
                ranked.append((score, i, u))
        ranked.sort()
        order = [(i, w) for _, i, u in ranked for w in reversed(unit_words[i, u])]
        keep = fit_drop(pieces, order, request.budget(), request.count_tokens)
        texts = [None if s.protected else "".join(p for p, ok in zip(pieces[i], keep[i]) if ok)
                 for i, s in enumerate(request.segments)]
        return assemble(request, texts)
