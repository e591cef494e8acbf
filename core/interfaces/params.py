"""``SamplingParams``: how one request is decoded. Bad values fail when it is created.

Every field is checked into a range the engine can run, so no single request can make a
step raise: ``top_k`` <= ``MAX_TOP_K``, ``seed`` in [0, 2**64), ``n`` <= ``MAX_N``, finite
``temperature`` / ``top_p`` / ``min_p``, at most ``MAX_STOP_STRINGS`` stop strings of at most
``MAX_STOP_CHARS`` characters each. A temperature below ``GREEDY_EPSILON`` (but above 0) is
greedy: dividing logits by it overflows float32 to inf/NaN, which would sample garbage.

The logits adjustments (``lmplug.kit.penalties``) take OpenAI's ranges: presence and
frequency penalties in [-2, 2], ``logit_bias`` values in [-100, 100] for at most
``MAX_LOGIT_BIAS`` token ids (JSON sends the ids as strings, so digit strings are accepted and
converted); ``repetition_penalty`` (HF / vLLM) in (0, ``MAX_REPETITION_PENALTY``]. Token ids
are checked against the model's vocabulary when the engine admits a request
(``check_token_ids``), since the params alone do not know it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lmplug.errors import ConfigError
from lmplug.interfaces.constraint import StructuredOutput
from lmplug.interfaces.denoising import DenoisingParams

MAX_N = 64  # samples of one request
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**64  # exclusive: what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # token ids in one logit_bias (OpenAI's limit is lower; vLLM takes any)
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_PENALTY = 2.0  # presence / frequency: OpenAI's range [-2, 2]
MAX_REPETITION_PENALTY = 100.0  # multiplicative; any larger is a mask, not a penalty
MAX_TOKEN_ID = 2**63  # exclusive: what a torch.long index holds
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
    # structured output: what the output must match (``lmplug.interfaces.constraint``); None: free text
    structured: StructuredOutput | None = None
    # logits adjustments, applied before the constraint mask and temperature (``lmplug.kit.penalties``)
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF: tokens seen in prompt or output, logit < 0 ? * p : / p
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are blocked until this many tokens are out
    # this request must sample the target distribution exactly: refused where speculative decoding
    # verifies with a lossy acceptance rule (``lmplug.interfaces.acceptance``)
    exact: bool = False
    # beam search (``lmplug.beam``): 0 = off; else this many beams, ``n`` of them returned (n <= beam_width)
    beam_width: int = 0
    length_penalty: float = 1.0  # a hypothesis scores cum_logprob / new_tokens ** length_penalty
    early_stopping: bool | str = False  # True / False / "never", as transformers defines them
    # sample best_of sequences, return the n with the highest cumulative logprob (OpenAI / vLLM); None: n
    best_of: int | None = None
    # block diffusion (``lmplug.diffusion``): how each canvas is denoised, a ``DenoisingParams`` or
    # a dict of its fields; a block-diffusion model denoises with the defaults when None
    denoising: DenoisingParams | None = None

    def __post_init__(self) -> None:
        self.denoising = DenoisingParams.coerce(self.denoising)
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
        if isinstance(self.structured, dict):
            self.structured = StructuredOutput(**self.structured)
        _check(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
               type(self.structured).__name__, "None, a StructuredOutput or a dict of its fields")
        self._check_adjustments()
        _check(isinstance(self.exact, bool), "exact", self.exact, "a bool")
        self._check_beam()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20), name, value,
                   "None or an integer in [0, 20]")

    def _check_beam(self) -> None:
        _check(self.best_of is None or (_is_int(self.best_of) and self.n <= self.best_of <= MAX_N), "best_of",
               self.best_of, f"None or an integer in [n ({self.n}), {MAX_N}]")
        _check(not (self.best_of and self.beam_width), "best_of", self.best_of,
               "None with beam search (beam_width sets the beams)")
        _check(_is_int(self.beam_width) and self.beam_width >= 0, "beam_width", self.beam_width,
               "an integer >= 1 (0 = no beam search)")
        if not self.beam_width:
            return
        _check(self.n <= self.beam_width, "n", self.n,
               f"at most beam_width ({self.beam_width}): beam search returns n of its beams")
        _check(_is_number(self.length_penalty), "length_penalty", self.length_penalty, "a finite number")
        _check(self.early_stopping in (True, False, "never"), "early_stopping", self.early_stopping,
               'True, False or "never"')

    def _check_stops(self) -> None:
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", _count(self.stop),
               f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
               _first_bad_stop(self.stop), f"non-empty strings of at most {MAX_STOP_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", _count(self.stop_token_ids),
               f"at most {MAX_STOP_TOKEN_IDS} token ids")
        _check(all(_is_int(t) and 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "token ids (integers >= 0)")

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY, name, value,
                   f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", self.repetition_penalty,
               f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"at most max_tokens ({self.max_tokens})")
        self.logit_bias = _logit_bias(self.logit_bias)

    @property
    def needs_adjusting(self) -> bool:
        """Any of penalties, logit_bias or min_tokens is on (``lmplug.kit.penalties``)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids the model cannot produce: ``logit_bias`` keys and ``stop_token_ids`` must be
    below ``vocab_size``. The engine calls this when it admits a request (an id past the logits row
    would otherwise fail inside a batched step)."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ConfigError(f"SamplingParams.{name} has token id {bad[0]}, but the model's vocabulary has "
                              f"{vocab_size} tokens (ids 0..{vocab_size - 1})")


def _logit_bias(bias: object) -> dict[int, float] | None:
    """Checked ``logit_bias`` with int keys and float values; None when empty."""
    if bias is None:
        return None
    _check(isinstance(bias, dict), "logit_bias", _Shown(type(bias).__name__), "None or a dict {token id: bias}")
    _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", _count(list(bias)), f"at most {MAX_LOGIT_BIAS} token ids")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id(key)
        _check(token is not None, "logit_bias", _Shown(f"{{{key!r}: ...}}"),
               "token ids (integers >= 0, or strings of digits) as keys")
        _check(_is_number(value) and -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE, "logit_bias",
               _Shown(f"{{{key!r}: {value!r}}}"), f"biases that are numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, "
               f"{MAX_LOGIT_BIAS_VALUE:g}]")
        _check(token not in out, "logit_bias", _Shown(f"{{{key!r}: ...}}"), "each token id once")
        out[token] = float(value)
    return out or None


def _token_id(key: object) -> int | None:
    """An int token id, or a string of ASCII digits (OpenAI's JSON keys), as an int; else None."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:  # int() refuses huge strings
        key = int(key)
    return key if _is_int(key) and 0 <= key < MAX_TOKEN_ID else None


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
