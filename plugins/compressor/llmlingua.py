"""``llmlingua``: LLMLingua (Jiang, Wu, Lin, Yang and Qiu, 2023, "LLMLingua: Compressing Prompts for
Accelerated Inference of Large Language Models", EMNLP 2023, arXiv:2310.05736).

The method, as built here (protected segments play the paper's instruction and question, kept whole):

1. Budget controller (coarse). The unprotected text splits into paragraphs (the paper's
   demonstrations). When ``coarse_factor * rate < 1``, each paragraph's perplexity under the
   scorer ranks it, and paragraphs are kept, highest perplexity first, until they hold
   ``coarse_factor * rate`` of the unprotected tokens; the rest go whole.
2. Iterative token-level compression (fine). What is left is cut into chunks of ``chunk_tokens``
   scorer tokens. Chunk by chunk, in prompt order, each token's ``-log p`` is computed *given the
   already-compressed prompt before it* (its last ``context_tokens`` tokens: protected text as
   is, earlier chunks as compressed), and the chunk keeps only tokens above a threshold chosen so
   the chunk meets its share of the remaining budget (the lowest-perplexity, most predictable
   tokens go first).
3. The cut is then settled once over the whole prompt (``fit_drop``, same order) so the achieved
   rate, in target-model tokens, lands on the target despite seams between chunks and a scorer
   tokenizer that may differ from the target's.
"""

from __future__ import annotations

import math

from lmplug_compressor.units import assemble, paragraphs
from pydantic import Field

from lmplug.interfaces.compressor import (
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
        kept_text = self._coarse(request, scorer, budget)
        pieces: list[list[str]] = []
        dropped: list[tuple[float, int, int]] = []  # (nll, segment, piece) the chunks dropped
        kept: list[tuple[float, int, int]] = []
        unprotected = sum(count(t) for t in kept_text if t is not None)
        fine_rate = min(1.0, budget / unprotected) if unprotected else 1.0
        prefix: list[int] = []
        for i, (segment, text) in enumerate(zip(request.segments, kept_text)):
            ids, toks = scorer.pieces(segment.text if text is None else text)
            pieces.append([] if text is None else toks)
            if text is None:
                prefix.extend(ids)
                continue
            size = self.options.chunk_tokens
            for start in range(0, len(ids), size):
                chunk_ids, chunk_toks = ids[start:start + size], toks[start:start + size]
                context = prefix[-self.options.context_tokens:] if self.options.context_tokens else []
                lps = scorer.token_logprobs(context + chunk_ids)[len(context):]
                nll = [-lp for lp in lps]
                if not context and nll and lps[0] == 0.0:  # unconditioned first token: nothing known
                    nll[0] = math.inf
                order = sorted(range(len(chunk_ids)), key=lambda k: (nll[k], k))
                chunk_budget = round(fine_rate * count("".join(chunk_toks)))
                (keep,) = fit_drop([chunk_toks], [(0, k) for k in order], chunk_budget, count)
                for k, ok in enumerate(keep):
                    (kept if ok else dropped).append((nll[k], i, start + k))
                prefix.extend(t for t, ok in zip(chunk_ids, keep) if ok)
        order = [(i, j) for _, i, j in sorted(dropped)] + [(i, j) for _, i, j in sorted(kept)]
        keep_all = fit_drop(pieces, order, budget, count)
        texts = [None if t is None else "".join(p for p, ok in zip(pieces[i], keep_all[i]) if ok)
                 for i, t in enumerate(kept_text)]
        return assemble(request, texts)

    def _coarse(self, request: CompressionInput, scorer: Scorer, budget: int) -> list[str | None]:
        """Per segment: None (protected) or its text after the budget controller."""
        texts = [None if s.protected else s.text for s in request.segments]
        target = self.options.coarse_factor * budget
        paras = [(i, p) for i, t in enumerate(texts) if t for p in paragraphs(t)]
        total = sum(request.count_tokens(p) for _, p in paras)
        if len(paras) < 2 or target >= total:
            return texts
        scored = scorer.token_logprobs_batch([scorer.tokenize(p) for _, p in paras])
        ppl = [-sum(lps) / len(lps) if lps else 0.0 for lps in scored]
        chosen, have = set(), 0
        for k in sorted(range(len(paras)), key=lambda k: (-ppl[k], k)):
            if have >= target:
                break
            chosen.add(k)
            have += request.count_tokens(paras[k][1])
        out = [None if t is None else "" for t in texts]
        for k, (i, p) in enumerate(paras):
            if k in chosen:
                out[i] += p
        return out
