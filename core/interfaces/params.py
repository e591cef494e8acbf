"""``SamplingParams``: how one request is decoded. Bad values fail when it is created.

Every field is checked into a range the engine can run, so no single request can make a
step raise: ``top_k`` <= ``MAX_TOP_K``, ``seed`` in [0, 2**64), ``n`` <= ``MAX_N``, finite
``temperature`` / ``top_p`` / ``min_p``, at most ``MAX_STOP_STRINGS`` stop strings of at most
``MAX_STOP_CHARS`` characters each. A temperature below ``GREEDY_EPSILON`` (but above 0) is
greedy: dividing logits by it overflows float32 to inf/NaN, which would sample garbage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lmplug.errors import ConfigError

MAX_N = 64  # samples of one request
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**64  # exclusive: what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
GREEDY_EPSILON = 1e-5  # temperatures in (0, GREEDY_EPSILON) decode greedily


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen one always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", self.n, f"an integer in [1, {MAX_N}]")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 (or None)")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               f"a finite number >= 0 (0 or below {GREEDY_EPSILON} = greedy)")
        _check(_is_int(self.top_k) and (-1 <= self.top_k <= MAX_TOP_K), "top_k", self.top_k,
               f"0 or -1 (off) or an integer in [1, {MAX_TOP_K}]")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed", self.seed,
               "None or an integer in [0, 2**64)")
        self._check_stops()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20), name, value,
                   "None or an integer in [0, 20]")

    def _check_stops(self) -> None:
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", _count(self.stop),
               f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
               _first_bad_stop(self.stop), f"non-empty strings of at most {MAX_STOP_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", _count(self.stop_token_ids),
               f"at most {MAX_STOP_TOKEN_IDS} token ids")
        _check(all(_is_int(t) and 0 <= t < 2**63 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "token ids (integers >= 0)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool): inf and NaN are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Shown(str):
    """A value shown as is in an error (a summary of a long list, not the list)."""

    def __repr__(self) -> str:
        return str(self)


def _count(items: list) -> _Shown:
    return _Shown(f"<{len(items)} items>")


def _first_bad_stop(stop: list) -> object:
    bad = next((s for s in stop if not (isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS)), None)
    if isinstance(bad, str) and len(bad) > 40:
        return _Shown(f"<a string of {len(bad)} characters>")
    return bad


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name}={value!r} is invalid: expected {expected}")
