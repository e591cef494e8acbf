"""``SamplingParams``: how one request is decoded. Bad values fail when it is created."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmplug.errors import ConfigError


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
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 (or None)")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature, "a number >= 0 (0 = greedy)")
        _check(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), "top_k", self.top_k,
               "0 or -1 (off) or a positive integer")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "token ids (integers >= 0)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20), name, value,
                   "None or an integer in [0, 20]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name}={value!r} is invalid: expected {expected}")
