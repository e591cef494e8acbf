"""``truncate``: middle-out truncation, the baseline every scoring method must beat.

The unprotected text of the prompt (all unprotected segments, in order, as one run of words) keeps
its head and its tail and loses a contiguous middle, so that the kept words have ``rate`` of the
unprotected target tokens. ``head`` is the share of the kept text taken from the front. No model is
involved; the cut is on word boundaries.
"""

from __future__ import annotations

from lmplug_compression.units import assemble, words
from pydantic import Field

from lmplug.api import (
    CompressionInput,
    CompressionResult,
    Compressor,
    CompressorOptions,
    Scorer,
    fit_drop,
)


class TruncateOptions(CompressorOptions):
    head: float = Field(default=0.5, gt=0, lt=1, description="share of the kept words taken from the start "
                        "of the unprotected text (the rest from its end)")


class Truncate(Compressor):
    name = "truncate"
    Options = TruncateOptions

    def compress(self, request: CompressionInput, scorer: Scorer | None) -> CompressionResult:
        pieces = [words(s.text) if not s.protected else [] for s in request.segments]
        flat = [(i, j) for i, p in enumerate(pieces) for j in range(len(p))]
        head = self.options.head
        split = round(head * len(flat))
        # middle-out: distance from the split point, scaled so the kept head:tail ratio is head:(1-head)
        order = sorted(range(len(flat)), key=lambda k: ((split - k) / head if k < split
                                                        else (k - split + 1) / (1 - head), k))
        keep = fit_drop(pieces, [flat[k] for k in order], request.budget(), request.count_tokens)
        texts = [None if s.protected else "".join(p for p, ok in zip(pieces[i], keep[i]) if ok)
                 for i, s in enumerate(request.segments)]
        return assemble(request, texts)
