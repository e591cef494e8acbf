"""``CompressorConformance``: what every prompt-compression method must hold to.

- protected segments come back byte-identical, in place, still protected;
- the achieved rate (unprotected target tokens after / before, each segment counted alone: the
  definition in ``lmplug.interfaces.compressor``) is within ``RATE_TOLERANCE`` of the target,
  recounted here rather than taken from the method's own figures;
- the same input gives the same output (twice on one instance, and on a fresh one);
- a rate outside (0, 1] is refused with an error naming ``rate``;
- an empty prompt, an all-protected prompt and rate 1 come back unchanged.

A method that needs a scorer gets one from the ``scorer`` fixture, which a subclass overrides
(the first-party tests use ``lmplug.compression.EngineScorer`` over a tiny model); the target
tokenizer is the ``count_tokens`` fixture (default: words and punctuation marks).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import ClassVar

import pytest
from pydantic import ValidationError

from lmplug.errors import ConfigError
from lmplug.interfaces.compressor import (
    RATE_TOLERANCE,
    CompressionInput,
    CompressionResult,
    Compressor,
    Scorer,
    Segment,
)
from lmplug.testing.base import Conformance
from lmplug.testing.compare import fail

_TOKENS = re.compile(r"\w+|[^\w\s]")
_WORDS = ["river", "mountain", "station", "garden", "window", "paper", "engine", "music", "harbor", "lantern", "copper", "valley", "orchard", "signal", "meadow", "ledger", "castle", "pepper", "ribbon", "candle", "marble", "thunder"]


def document(paragraphs: int = 4, sentences: int = 3, seed: int = 0) -> str:
    """Seeded filler text: paragraphs of sentences, with commas, so phrases and sentences exist."""
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sents = []
        for _ in range(sentences):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 11))]
            words.insert(rng.randint(2, len(words) - 2), words.pop() + ",")
            sents.append(" ".join(words).capitalize() + ".")
        out.append(" ".join(sents))
    return "\n\n".join(out)


class CompressorConformance(Conformance):
    family = "compression"
    rates: ClassVar[list[float]] = [0.5, 0.33]
    paragraphs: ClassVar[int] = 4  # the size of the test prompt (the scorer scores all of it)

    @pytest.fixture(scope="class")
    @classmethod
    def scorer(cls) -> Scorer | None:
        """Override for methods with ``needs_scorer``."""
        return None

    @pytest.fixture(scope="class")
    @classmethod
    def count_tokens(cls) -> Callable[[str], int]:
        return lambda text: len(_TOKENS.findall(text))

    @pytest.fixture(scope="class")
    @classmethod
    def compressor(cls, backend_class, backend_options, scorer) -> Compressor:
        if backend_class.needs_scorer and scorer is None:
            fail(f"{cls.label()} needs a scorer: override the `scorer` fixture")
        return backend_class(backend_options)

    def segments(self) -> tuple[Segment, ...]:
        """Context, a protected span inside it, more context, the protected question."""
        return (Segment(document(self.paragraphs // 2, seed=1) + "\n\n"),
                Segment("The vault code is 4721.", protected=True),
                Segment(" " + document(self.paragraphs - self.paragraphs // 2, seed=2) + "\n\n"),
                Segment("Question: what is the vault code? Answer:", protected=True))

    def run(self, compressor: Compressor, scorer, count_tokens, rate: float,
            segments: tuple[Segment, ...] | None = None) -> tuple[CompressionInput, CompressionResult]:
        request = CompressionInput(self.segments() if segments is None else segments, rate, count_tokens)
        result = compressor.compress(request, scorer)
        if not isinstance(result, CompressionResult):
            fail(f"{self.label()}: compress returned {type(result).__name__}, not a CompressionResult")
        return request, result

    # -- the checks -----------------------------------------------------------------------
    def test_protected_spans_survive_byte_exact(self, compressor, scorer, count_tokens):
        for rate in self.rates:
            request, result = self.run(compressor, scorer, count_tokens, rate)
            assert len(result.segments) == len(request.segments), f"rate {rate}: segment count changed"
            for k, (a, b) in enumerate(zip(request.segments, result.segments)):
                if a.protected:
                    assert b.protected and b.text == a.text, f"rate {rate}: protected segment {k} changed"

    def test_rate_within_tolerance(self, compressor, scorer, count_tokens):
        for rate in self.rates:
            request, result = self.run(compressor, scorer, count_tokens, rate)
            before = sum(count_tokens(s.text) for s in request.segments if not s.protected)
            after = sum(count_tokens(s.text) for s in result.segments if not s.protected)
            achieved = after / before
            assert abs(achieved / rate - 1) <= RATE_TOLERANCE, (
                f"{self.label()}: target rate {rate}, achieved {achieved:.3f} ({after}/{before} tokens)")
            assert (result.tokens_before, result.tokens_after) == (before, after), \
                "CompressionResult's token counts are not the rate's (see lmplug.interfaces.compressor)"

    def test_deterministic(self, compressor, backend_class, backend_options, scorer, count_tokens):
        first = self.run(compressor, scorer, count_tokens, self.rates[0])[1]
        again = self.run(compressor, scorer, count_tokens, self.rates[0])[1]
        fresh = self.run(backend_class(backend_options), scorer, count_tokens, self.rates[0])[1]
        assert first.segments == again.segments == fresh.segments

    def test_rate_outside_range_refused(self, backend_class, count_tokens):
        for rate in (0, -0.5, 1.5, float("nan")):
            with pytest.raises(ValidationError, match="rate"):
                backend_class.Options(rate=rate)
            with pytest.raises(ConfigError, match="rate"):
                CompressionInput(self.segments(), rate, count_tokens)

    def test_nothing_to_compress_is_unchanged(self, compressor, scorer, count_tokens):
        all_protected = tuple(Segment(s.text, True) for s in self.segments())
        for segments in ((), all_protected, (Segment(""), Segment("Q?", True))):
            _, result = self.run(compressor, scorer, count_tokens, 0.5, segments)
            assert result.segments == segments
        request, result = self.run(compressor, scorer, count_tokens, 1.0)
        assert result.text == "".join(s.text for s in request.segments), "rate 1 must keep everything"
