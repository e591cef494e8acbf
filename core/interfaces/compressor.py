"""Prompt compression: the ``compressor`` family (methods that make a prompt shorter before prefill).

A request asks for compression with ``CompressionParams`` (or the engine config's ``compression:``
section is the default for every request). The core splits the prompt into ``Segment`` s in order,
marking protected what must survive byte-exact (chat-role markup is never handed over; the system
prompt, the final question and every span the caller names are protected segments), and calls
``Compressor.compress`` with a ``CompressionInput``: the segments, the target ``rate`` and a token
counter of the *target* model's tokenizer. Methods that score text (``needs_scorer``) also get a
``Scorer``: a small causal LM's log-probabilities.

The rate is measured over the unprotected part only, in target-model tokens::

    achieved = sum(count_tokens(s.text) for unprotected output segments)
             / sum(count_tokens(s.text) for unprotected input segments)

Protected tokens count in neither (they are never removed). Each segment is counted alone, without
special tokens. A method must land within ``RATE_TOLERANCE`` (relative) of the target; ``fit_drop``
is the shared helper that does, given an order in which to drop pieces of a segment.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from lmplug.errors import ConfigError
from lmplug.interfaces.common import BackendOptions, Capabilities

RATE_TOLERANCE = 0.05  # relative: an achieved rate within target * (1 +- 0.05)
MAX_PROTECT = 64  # protected substrings in one request
MAX_PROTECT_CHARS = 1 << 17  # their characters in all: finding them is linear in this and the prompt


def check_rate(rate: Any, where: str = "compression.rate") -> float:
    """``rate`` as a float in (0, 1], or a ``ConfigError`` naming ``where``."""
    ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and 0 < rate <= 1
    if not ok:
        raise ConfigError(f"{where}: expected a number in (0, 1] (compressed / original prompt tokens), "
                          f"got {rate!r}")
    return float(rate)


@dataclass(frozen=True)
class Segment:
    """One piece of the prompt, in order. A protected segment comes back byte-identical."""

    text: str
    protected: bool = False


@dataclass(frozen=True)
class CompressionInput:
    """What a compressor gets: the segments in order, the target rate (compressed / original
    unprotected target tokens), the target tokenizer's counter (no special tokens) and, when the
    core split one off, the final question's text (also in a protected segment; question-aware
    methods condition their scores on it)."""

    segments: tuple[Segment, ...]
    rate: float
    count_tokens: Callable[[str], int]
    question: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "rate", check_rate(self.rate))

    def budget(self) -> int:
        """Target tokens the unprotected part may keep."""
        return round(self.rate * sum(self.count_tokens(s.text) for s in self.segments if not s.protected))


@dataclass(frozen=True)
class CompressionResult:
    """The output segments (protected ones byte-identical, in the same places) and the
    unprotected target-token counts before and after."""

    segments: tuple[Segment, ...]
    tokens_before: int
    tokens_after: int

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def rate(self) -> float:
        return self.tokens_after / self.tokens_before if self.tokens_before else 1.0


@dataclass(frozen=True)
class CompressionReport:
    """What ``RequestOutput.compression`` tells the caller: whole-prompt token counts before and
    after (as the engine sees them), the method, its seconds, and why it fell back if it did
    (then the full prompt was used)."""

    method: str
    rate: float  # the target
    prompt_tokens_before: int
    prompt_tokens_after: int
    seconds: float
    fallback: str | None = None


class Scorer(ABC):
    """A small causal LM as a compressor sees it: its tokenizer and per-token log-probabilities.

    ``pieces`` splits text into the scorer's tokens *and* the text of each (their concatenation
    is the text exactly), so a method can drop tokens without decoding. ``token_logprobs(ids)``
    is ``log p(ids[i] | ids[:i])`` for each i (the first conditioned on BOS where the model has
    one, else 0.0); texts longer than the scorer's context are scored in overlapping windows.
    """

    @abstractmethod
    def pieces(self, text: str) -> tuple[list[int], list[str]]:
        """Token ids of ``text`` (no special tokens) and the text of each, joining to ``text``."""

    def tokenize(self, text: str) -> list[int]:
        return self.pieces(text)[0]

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        ...

    @abstractmethod
    def token_logprobs(self, ids: Sequence[int]) -> list[float]:
        ...

    def token_logprobs_batch(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        """Several at once (the core's scorer runs them as one batch)."""
        return [self.token_logprobs(ids) for ids in batch]


class CompressorOptions(BackendOptions):
    """``compression:`` section options every method takes. ``scorer`` is read by the core (it
    builds the ``Scorer``); the per-request ``CompressionParams`` cannot change it."""

    rate: float = Field(default=0.5, gt=0, le=1, description="target ratio of compressed to original "
                        "unprotected prompt tokens (target-model tokens), in (0, 1]")
    scorer: str | None = Field(default=None, description="methods that score text: the model that scores "
                               "(a name in the cache, HF folder or .gguf file); default: the engine's own")
    scorer_max_len: int = Field(default=1024, ge=16, description="the scorer's context: longer texts are "
                                "scored in overlapping windows of this many tokens")


class Compressor(ABC):
    """One compression method. Stateless between calls, deterministic (same input, same output),
    thread-safe (the server calls it from worker threads)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options: ClassVar[type[CompressorOptions]] = CompressorOptions
    needs_scorer: ClassVar[bool] = False

    def __init__(self, options: CompressorOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def compress(self, request: CompressionInput, scorer: Scorer | None) -> CompressionResult:
        """Shorten the unprotected segments of ``request`` to ``request.rate`` (see the module)."""


@dataclass(frozen=True)
class CompressionParams:
    """A request's compression: ``method`` (None: the config's), ``rate`` (None: the method's
    option), ``protect``: substrings of the prompt that must survive byte-exact (each must occur
    in it), ``options``: other options of the method (validated by its ``Options``)."""

    method: str | None = None
    rate: float | None = None
    protect: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method is not None and (not isinstance(self.method, str) or not self.method):
            raise ConfigError(f"compression.method: expected a method name, got {self.method!r}")
        if self.rate is not None:
            object.__setattr__(self, "rate", check_rate(self.rate))
        protect = (self.protect,) if isinstance(self.protect, str) else tuple(self.protect or ())
        if len(protect) > MAX_PROTECT or not all(isinstance(p, str) and p for p in protect):
            raise ConfigError(f"compression.protect: expected at most {MAX_PROTECT} non-empty strings")
        total = sum(len(p) for p in protect)
        if total > MAX_PROTECT_CHARS:
            raise ConfigError(f"compression.protect: {total} characters in all, at most {MAX_PROTECT_CHARS}")
        object.__setattr__(self, "protect", protect)
        if not isinstance(self.options, dict):
            raise ConfigError(f"compression.options: expected a mapping, got {type(self.options).__name__}")
        for key in ("rate", "scorer", "scorer_max_len"):
            if key in self.options:
                raise ConfigError(f"compression.options.{key}: not a per-request option"
                                  + (" (use compression.rate)" if key == "rate" else
                                     " (the scorer is chosen in the engine config's compression section)"))

    @classmethod
    def coerce(cls, value: CompressionParams | dict | None) -> CompressionParams | None:
        """Accept the params, a dict of their fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"compression: expected CompressionParams, a dict or None, got {type(value).__name__}")
        unknown = set(value) - {"method", "rate", "protect", "options"}
        if unknown:
            raise ConfigError(f"compression.{min(unknown)}: unknown field "
                              "(allowed: method, rate, protect, options)")
        return cls(**value)


def fit_drop(pieces: Sequence[Sequence[str]], order: Sequence[tuple[int, int]], budget: int,
             count_tokens: Callable[[str], int]) -> list[list[bool]]:
    """Which pieces to keep so that the kept text has about ``budget`` target tokens.

    ``pieces[i]`` splits segment ``i`` (its pieces join to its text; a segment left alone has
    none); ``order`` lists ``(segment, piece)`` in the order they should go (first = least worth
    keeping). The count is the rate's: each segment's kept text counted alone, summed. Dropping
    the first ``k`` of ``order``, the smallest ``k`` whose count is <= ``budget`` is found by
    bisection (the count is monotone in ``k`` up to tokenizer merges at the seams), then one piece
    fewer if that lands closer; with word- or token-sized pieces the result is within a token or
    two of ``budget``.
    """
    def kept(k: int) -> list[list[bool]]:
        keep = [[True] * len(p) for p in pieces]
        for i, j in order[:k]:
            keep[i][j] = False
        return keep

    def count(k: int) -> int:
        return sum(count_tokens("".join(p for p, ok in zip(seg, flags) if ok))
                   for seg, flags in zip(pieces, kept(k)) if seg)

    lo, hi = 0, len(order)
    if count(lo) <= budget:
        return kept(lo)
    while lo < hi:  # the answer is in [lo, hi]; count(len(order)) is the floor
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    if hi > 0 and abs(count(hi - 1) - budget) < abs(count(hi) - budget):
        hi -= 1
    return kept(hi)
