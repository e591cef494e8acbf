"""Structured output: the ``constraint`` family (grammar engines that keep output inside a language).

A request asks for a constraint with ``SamplingParams(structured=StructuredOutput(...))``: a JSON
schema, any JSON object, a regular expression, a choice among fixed strings, or an EBNF grammar.
A ``ConstraintBackend`` (xgrammar, llguidance, or a third party's) compiles it for the model's
tokenizer once (``compile_cached``: an LRU keyed by ``StructuredOutput.key``) and hands out one
``Matcher`` per sequence. Each step, for every constrained row, the engine asks the matcher to fill
a row of a token bitmask, applies all rows with one op (``apply_bitmask``) before temperature and
filtering, and afterwards feeds the matcher the tokens the sequence really kept (``accept``).
Speculative decoding advances a matcher through the draft to get each position's mask and rolls
it back (``rollback``) before the verdict is known. Beam search gives a beam that takes over
another's tokens a copy of that beam's matcher (``fork``).

The bitmask layout is xgrammar's and llguidance's: int32 words, ``ceil(vocab / 32)`` per row;
token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is set. Ids past the tokenizer's
vocabulary (the padded rows of an LM head) are never allowed.
"""

from __future__ import annotations

import json as _json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from lmplug.errors import ConfigError
from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.constraint_checks import check_before_compile, check_satisfiable

if TYPE_CHECKING:
    import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # one constraint's text (schema, regex, grammar, all choices together)
MAX_CHOICES = 4096


class ConstraintError(ConfigError):
    """A constraint that cannot be compiled. ``field`` names what was wrong (``json``, ``regex``,
    ``choice``, ``grammar``), so the server can name the request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; exactly one of the fields is set.

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: one of these strings
    exactly; ``grammar``: an EBNF grammar (GBNF syntax, root rule ``root``).
    ``whitespace_flexible``: JSON may contain any whitespace between tokens (otherwise the
    compact form with single spaces after ``,`` and ``:``, as the backends default to).
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False
    _schema_text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_fields) != 1:
            raise ConstraintError("structured", "SamplingParams.structured: expected exactly one of "
                                  f"{', '.join(KINDS)}; got {', '.join(set_fields) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "_schema_text", _schema_text(self.json))
        if self.json_object is not True and self.json_object is not False:
            raise ConstraintError("json_object", "SamplingParams.structured.json_object: expected a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS):
                raise ConstraintError(name, f"SamplingParams.structured.{name}: expected a non-empty string "
                                      f"of at most {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            ok = (0 < len(self.choice) <= MAX_CHOICES and all(isinstance(c, str) and c for c in self.choice)
                  and sum(len(c) for c in self.choice) <= MAX_SPEC_CHARS)
            if not ok:
                raise ConstraintError("choice", "SamplingParams.structured.choice: expected 1 to "
                                      f"{MAX_CHOICES} non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema_text(self) -> str:
        """The JSON schema as compact JSON text, keys in the order given (``json`` only; "" otherwise)."""
        return self._schema_text

    @property
    def key(self) -> tuple:
        """What compiling depends on: equal keys share one compiled constraint."""
        value = {"json": self._schema_text, "json_object": True, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar}[self.kind]
        return (self.kind, value, self.whitespace_flexible)


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise ConstraintError("json", f"SamplingParams.structured.json: a schema of {len(schema)} "
                                  f"characters (at most {MAX_SPEC_CHARS})")
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise ConstraintError("json", f"SamplingParams.structured.json: not valid JSON text: {exc}") from None
        except RecursionError:  # "[" * 5000: nested past what Python's decoder can follow
            raise ConstraintError("json", "SamplingParams.structured.json: the JSON text nests too deeply "
                                  "to read") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("json", "SamplingParams.structured.json: expected a JSON schema (an object), "
                              f"got {type(schema).__name__}")
    try:
        # keys keep their order: grammar engines emit properties in the order the schema lists them
        text = _json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConstraintError("json", f"SamplingParams.structured.json: not serialisable as JSON: {exc}") from None
    except RecursionError:
        raise ConstraintError("json", "SamplingParams.structured.json: the schema nests too deeply to "
                              "serialise") from None
    if len(text) > MAX_SPEC_CHARS:
        raise ConstraintError("json", f"SamplingParams.structured.json: a schema of {len(text)} characters "
                              f"(at most {MAX_SPEC_CHARS})")
    return text


@dataclass(frozen=True)
class ConstraintTokenizer:
    """What a grammar engine needs of the model's tokenizer.

    ``tokenizer``: the ``tokenizers.Tokenizer`` the engine encodes with; ``vocab_size``: the width
    of the model's logits (may exceed the tokenizer's vocabulary); ``eos_token_ids``: the tokens
    that end a sequence (allowed once the constraint is complete).
    """

    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]


class ConstraintOptions(BackendOptions):
    cache_size: int = Field(default=256, ge=1, le=65536, description="compiled constraints kept (LRU)")
    cache_bytes: int = Field(default=512 << 20, ge=1, description="memory the compiled constraints kept may "
                             "take together (LRU, each entry's size as its backend estimates it); one larger "
                             "than this is compiled for its request and not kept")
    max_compile_s: float = Field(default=30.0, gt=0, description="longest compile of one constraint; "
                                 "slower ones are stopped (their worker process killed) and refused with an "
                                 "error naming this limit")
    compile_workers: int = Field(default=1, ge=1, le=64, description="worker processes that compile "
                                 "constraints off the engine thread (0 is not allowed: the engine thread "
                                 "would stall)")
    compile_queue: int = Field(default=64, ge=1, le=100_000, description="constraints that may wait for a "
                               "compile worker; more are refused")
    max_schema_depth: int = Field(default=64, ge=1, le=10000, description="deepest nesting of a JSON "
                                  "schema (objects and arrays) accepted; deeper ones are refused before compiling")
    max_enum_values: int = Field(default=4096, ge=1, le=1_000_000, description="most values one JSON "
                                 "schema enum, or one guided_choice, may list; more are refused before compiling")
    max_repeat: int = Field(default=10_000, ge=1, le=1_000_000_000, description="most copies a counted "
                            "repetition in a regex or grammar may ask for (x{n}, its count times those of the "
                            "groups around it: (a{1000}){1000} is 1,000,000); more are refused before compiling")
    max_grammar_chars: int = Field(default=MAX_SPEC_CHARS, ge=1, le=MAX_SPEC_CHARS, description="longest "
                                   "constraint text (JSON schema, regex, grammar, all choices together); "
                                   "longer ones are refused before compiling")


class Matcher(ABC):
    """One sequence's position in a compiled constraint."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) if the constraint does not allow it."""

    @abstractmethod
    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``row`` (int32 [ceil(vocab / 32)], the layout above).
        When the constraint is complete only the EOS tokens are allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The constraint is complete and an EOS token was accepted."""

    def is_complete(self) -> bool:
        """The output so far is a whole match (EOS would be allowed now). Backends override."""
        return self.is_terminated()

    def fork(self) -> Matcher | None:
        """An independent copy at the same position (a beam that takes over another beam's
        tokens), or None when it cannot be copied: the engine then rolls the other matcher back to
        the tokens both beams share and replays the rest. Backends that can copy override."""
        return None


class ConstraintBackend(ABC):
    """A grammar engine. Built once per engine with the model's tokenizer; ``compile`` is called at
    request admission (so a bad schema fails the request at once, never mid-generation)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options: ClassVar[type[ConstraintOptions]] = ConstraintOptions
    kinds: ClassVar[frozenset[str]] = frozenset(KINDS)  # the StructuredOutput kinds it compiles

    def __init__(self, options: ConstraintOptions, tokenizer: ConstraintTokenizer) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    @abstractmethod
    def compile(self, spec: StructuredOutput) -> Any:
        """Compile ``spec`` for this tokenizer; raise ``ConstraintError`` naming the field when it
        cannot be compiled (invalid schema, regex or grammar)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of the compiled constraint."""

    def prepare(self) -> None:
        """Do the one-off work of the first compile now (import the engine, read the vocabulary), so
        the first constrained request does not pay it. The server calls it on a background thread at
        start; backends with such work override it."""

    def size_bytes(self, compiled: Any) -> int:
        """The memory ``compiled`` holds, as well as the backend can tell (the cache's measure).
        Backends override; the default counts nothing."""
        return 0

    def cached(self, spec: StructuredOutput) -> Any:
        """The compiled constraint if the cache holds it, else None."""
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
            return None if compiled is None else compiled[0]

    def compile_cached(self, spec: StructuredOutput) -> Any:
        """``compile`` once per ``spec.key`` (LRU of ``options.cache_size`` entries and
        ``options.cache_bytes`` bytes); thread-safe. Every limit is checked before compiling."""
        if spec.kind not in self.kinds:
            raise ConstraintError(spec.kind, f"structured output {spec.kind!r} is not supported by the "
                                  f"{self.name!r} constraint backend (it compiles {', '.join(sorted(self.kinds))})")
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        check_before_compile(spec, self.options)
        compiled = self.compile(spec)
        check_satisfiable(self, spec, compiled)
        self._store(spec.key, compiled)
        return compiled

    def _store(self, key: tuple, compiled: Any) -> None:
        size = self.size_bytes(compiled)
        if size > self.options.cache_bytes:
            return
        with self._lock:
            self._cache[key] = (compiled, size)
            held = sum(s for _, s in self._cache.values())
            while len(self._cache) > self.options.cache_size or held > self.options.cache_bytes:
                held -= self._cache.popitem(last=False)[1][1]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)], every token allowed."""
    import torch

    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size]: True where allowed."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set to -inf, in place, the logits a bitmask forbids; returns ``logits``.

    logits [N, V] float; bitmask int32 [M, ceil(V / 32)] (at least V bits); ``rows`` long [M]: the
    logits row each mask row applies to (None: M == N, row i to row i). One masked fill for all rows.
    """
    allowed = bitmask_to_bool(bitmask, logits.shape[-1])
    if rows is None:
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
        return logits
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits
