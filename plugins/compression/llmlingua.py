"""``llmlingua``: LLMLingua (Jiang, Wu, Lin, Yang and Qiu, 2023, "LLMLingua: Compressing Prompts for
Accelerated Inference of Large Language Models", EMNLP 2023, arXiv:2310.05736).

The method, as built here (protected segments play the paper's instruction and question, kept whole):

1. Budget controller (coarse). The unprotected text splits into paragraphs (the paper's
   demonstrations). When ``coarse_factor * rate < 1``, paragraphs are ranked and kept, best
   first, until they hold ``coarse_factor * rate`` of the unprotected tokens; the rest go whole.
   The rank is the paragraph's perplexity under the scorer (LLMLingua), or, when the request has
   a final question and ``question_aware`` is on, how likely the paragraph makes that question:
   the mean ``log p(question token | paragraph, question so far)`` (the question-aware coarse
   ranking of LongLLMLingua: Jiang, Wu, Luo, Li, Lin, Yang and Qiu, 2023, "LongLLMLingua:
   Accelerating and Enhancing LLMs in Long Context Scenarios via Prompt Compression",
   arXiv:2310.06839). Kept paragraphs stay in prompt order.
2. Iterative token-level compression (fine). What is left is cut into chunks of ``chunk_tokens``
   scorer tokens (a chunk may span paragraphs). Chunk by chunk, in prompt order, each token's
   ``-log p`` is computed *given the already-compressed prompt before it* (its last
   ``context_tokens`` tokens: protected text as is, earlier chunks as compressed), and each
   paragraph's part of the chunk keeps only tokens above a threshold chosen so that part meets
   its paragraph's rate (the lowest-perplexity, most predictable tokens go first). Every paragraph gets the same rate, except with the
   question-aware ranking: then, as LongLLMLingua's dynamic compression ratio, the rate falls
   linearly with the paragraph's rank, from 1 for the most relevant paragraph (kept whole) down,
   the slope chosen so the kept paragraphs together meet the budget.
3. The cut is then settled once over the whole prompt (``fit_drop``, same order) so the achieved
   rate, in target-model tokens, lands on the target despite seams between chunks and a scorer
   tokenizer that may differ from the target's.
"""

from __future__ import annotations

import math

from lmplug_compression.units import assemble, paragraphs
from pydantic import Field

from lmplug.api import (
    CompressionInput,
    CompressionResult,
    Compressor,
    CompressorOptions,
    Scorer,
    fit_drop,
)


class LLMLinguaOptions(CompressorOptions):
    coarse_factor: float = Field(default=2.0, ge=1, description="the budget controller keeps paragraphs "
                                 "holding coarse_factor * rate of the unprotected tokens (>= 1 / rate: off)")
    question_aware: bool = Field(default=True, description="rank paragraphs by how likely they make the final "
                                 "question (LongLLMLingua) when the request has one; false: by perplexity")
    chunk_tokens: int = Field(default=200, ge=8, le=4096, description="scorer tokens per iterative chunk")
    context_tokens: int = Field(default=128, ge=0, le=4096, description="compressed tokens before a chunk "
                                "that condition its scores")


class LLMLingua(Compressor):
    name = "llmlingua"
    Options = LLMLinguaOptions
    needs_scorer = True

    def compress(self, request: CompressionInput, scorer: Scorer | None) -> CompressionResult:
        if scorer is None:
            raise ValueError("llmlingua needs a scorer")
        count, budget = request.count_tokens, request.budget()
        kept_paras, ranked = self._coarse(request, scorer, budget)
        rates = _fine_rates([count(p) for ps in kept_paras if ps is not None for p in ps], budget, ranked)
        pieces: list[list[str]] = []
        dropped: list[tuple[float, int, int]] = []  # (nll, segment, piece) the chunks dropped
        kept: list[tuple[float, int, int]] = []
        prefix: list[int] = []
        next_para = 0
        for i, (segment, paras) in enumerate(zip(request.segments, kept_paras)):
            if paras is None:
                prefix.extend(scorer.tokenize(segment.text))
                pieces.append([])
                continue
            ids: list[int] = []
            toks: list[str] = []
            owner: list[int] = []  # each token's paragraph (an index into ``rates``)
            for para in paras:
                para_ids, para_toks = scorer.pieces(para)
                ids += para_ids
                toks += para_toks
                owner += [next_para] * len(para_ids)
                next_para += 1
            for start in range(0, len(ids), self.options.chunk_tokens):
                chunk = slice(start, start + self.options.chunk_tokens)
                keep, nll = self._fine_chunk(scorer, prefix, ids[chunk], toks[chunk], owner[chunk], rates, count)
                for k, ok in enumerate(keep):
                    (kept if ok else dropped).append((nll[k], i, start + k))
                prefix.extend(t for t, ok in zip(ids[chunk], keep) if ok)
            pieces.append(toks)
        order = [(i, j) for _, i, j in sorted(dropped)] + [(i, j) for _, i, j in sorted(kept)]
        keep_all = fit_drop(pieces, order, budget, count)
        texts = [None if paras is None else "".join(p for p, ok in zip(pieces[i], keep_all[i]) if ok)
                 for i, paras in enumerate(kept_paras)]
        return assemble(request, texts)

    def _fine_chunk(self, scorer: Scorer, prefix: list[int], ids: list[int], toks: list[str], owner: list[int],
                    rates: list[float], count) -> tuple[list[bool], list[float]]:
        """Which tokens of one chunk stay, and each token's ``-log p`` given the compressed prefix
        (and the chunk's tokens before it). The chunk is scored once; each paragraph's part of it
        keeps its paragraph's rate (a chunk whose paragraphs all have rate 1 is not scored)."""
        if all(rates[p] >= 1 for p in owner):
            return [True] * len(ids), [math.inf] * len(ids)
        context = prefix[-self.options.context_tokens:] if self.options.context_tokens else []
        lps = scorer.token_logprobs(context + ids)[len(context):]
        nll = [-lp for lp in lps]
        if not context and nll and lps[0] == 0.0:  # unconditioned first token: nothing known
            nll[0] = math.inf
        keep = [True] * len(ids)
        for para in dict.fromkeys(owner):  # each paragraph's run of the chunk, in order
            where = [k for k, p in enumerate(owner) if p == para]
            if rates[para] >= 1:  # kept whole, and the last to go when the cut is settled
                for k in where:
                    nll[k] = math.inf
                continue
            part = [toks[k] for k in where]
            order = sorted(range(len(where)), key=lambda k: (nll[where[k]], k))
            (flags,) = fit_drop([part], [(0, k) for k in order], round(rates[para] * count("".join(part))), count)
            for k, ok in zip(where, flags):
                keep[k] = ok
        return keep, nll

    def _coarse(self, request: CompressionInput, scorer: Scorer, budget: int
                ) -> tuple[list[list[str] | None], list[int] | None]:
        """Per segment: None (protected) or the paragraphs the budget controller keeps, in order;
        and, when paragraphs were ranked by the question, each kept paragraph's rank (0: best)."""
        texts = [None if s.protected else s.text for s in request.segments]
        split = [None if t is None else paragraphs(t) for t in texts]
        paras = [(i, p) for i, ps in enumerate(split) if ps for p in ps]
        total = sum(request.count_tokens(p) for _, p in paras)
        target = self.options.coarse_factor * budget
        question = request.question if self.options.question_aware else None
        if len(paras) < 2 or (target >= total and question is None) or budget >= total:
            return split, None
        score = self._relevance(scorer, [p for _, p in paras], question)
        by_rank = sorted(range(len(paras)), key=lambda k: (-score[k], k))
        chosen, have = set(), 0
        for k in by_rank:
            if have >= target:
                break
            chosen.add(k)
            have += request.count_tokens(paras[k][1])
        out: list[list[str] | None] = [None if t is None else [] for t in texts]
        for k, (i, p) in enumerate(paras):
            if k in chosen:
                out[i].append(p)
        rank = {k: r for r, k in enumerate(k for k in by_rank if k in chosen)}
        return out, [rank[k] for k in sorted(chosen)] if question else None

    def _relevance(self, scorer: Scorer, paras: list[str], question: str | None) -> list[float]:
        """Per paragraph, higher = keep first: the question's mean log-probability after it
        (question-aware), else the paragraph's own perplexity (mean negative log-probability)."""
        if question:
            q = scorer.tokenize(question)
            heads = [scorer.tokenize(p.rstrip() + "\n\n") for p in paras]
            scored = scorer.token_logprobs_batch([h + q for h in heads])
            return [sum(lps[len(h):]) / len(q) if q else 0.0 for h, lps in zip(heads, scored)]
        scored = scorer.token_logprobs_batch([scorer.tokenize(p) for p in paras])
        return [-sum(lps) / len(lps) if lps else 0.0 for lps in scored]


def _fine_rates(sizes: list[int], budget: int, ranked: list[int] | None) -> list[float]:
    """Each kept paragraph's token-level rate: one rate for all, or (``ranked``) 1 for rank 0
    falling linearly with rank, clipped at 0, the slope found by bisection so that the
    paragraphs' kept tokens add up to ``budget``."""
    total = sum(sizes)
    if not total or budget >= total:
        return [1.0] * len(sizes)
    if ranked is None or len(sizes) < 2:
        return [budget / total] * len(sizes)
    last = max(ranked)

    def rates(slope: float) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - slope * r / last)) for r in ranked]

    lo, hi = 0.0, float(len(sizes))  # slope len(sizes) keeps only rank 0 (and < total tokens)
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(r * n for r, n in zip(rates(mid), sizes)) > budget:
            lo = mid
        else:
            hi = mid
    return rates(hi)
