"""The ``llguidance`` constraint backend: structured output with Microsoft's llguidance.

llguidance computes each mask on the fly with a lexer over a token trie (no per-grammar
precomputation), so compiling is cheap and large, one-off schemas are fast to start.

The tokenizer is handed over as its ``tokenizers`` JSON (``LLTokenizer``), with ``n_vocab`` the
model's vocab_size; llguidance reads the special flags of added tokens itself and never allows a
special token except EOS, nor an id past the tokenizer's vocabulary.

JSON: llguidance's compiler (``additionalProperties`` as the schema says, i.e. allowed when
unstated; xgrammar is stricter); ``whitespace_flexible`` is its ``whitespace_flexible``,
otherwise separators ``", "`` and ``": "`` as xgrammar's. ``choice`` is a Lark alternation of the
strings as JSON-escaped literals (llguidance's own "choice" format); ``grammar`` is GBNF with
root rule ``root``, converted to Lark by llguidance's ``gbnf_to_lark``. Every grammar is
validated against the tokenizer at compile, so a bad one fails the request at admission.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
from lmplug_constraint.limits import compile_within, trim
from lmplug_constraint.vocab import allow_only, stop_ids, tokenizer_json

from lmplug.api import (
    Capabilities,
    ConstraintBackend,
    ConstraintError,
    ConstraintOptions,
    Matcher,
    StructuredOutput,
    bitmask_words,
)

BYTES_PER_GRAMMAR_CHAR = 64  # the cache's estimate of a compiled grammar's memory (see size_bytes)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE = {"whitespace_flexible": True}


class LLGuidanceBackend(ConstraintBackend):
    name = "llguidance"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), priority=10)
    Options = ConstraintOptions

    def __init__(self, options: ConstraintOptions, tokenizer) -> None:
        super().__init__(options, tokenizer)
        self._lltok: Any = None
        self._stops: list[int] = []
        self._init_lock = threading.Lock()

    def prepare(self) -> None:
        self._tokenizer()

    def compile(self, spec: StructuredOutput) -> Any:
        lltok = self._tokenizer()
        kind = spec.kind
        return compile_within(self.options.max_compile_s, kind, self.name,
                              lambda: self._build(lltok, spec))

    def size_bytes(self, compiled: Any) -> int:
        return compiled[1]

    def matcher(self, compiled: Any) -> Matcher:
        return LLGuidanceMatcher(compiled[0].deep_copy(), self.tokenizer.vocab_size, self._stops)

    def _build(self, lltok: Any, spec: StructuredOutput) -> Any:
        import llguidance

        grammar = _grammar_text(llguidance, spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if failed:
            raise ConstraintError(spec.kind, f"structured output {spec.kind}: llguidance cannot compile it: "
                                  f"{trim(messages[0] if messages else 'invalid grammar')}")
        template = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if template.is_error():
            raise ConstraintError(spec.kind, f"structured output {spec.kind}: llguidance cannot compile it: "
                                  f"{trim(template.get_error())}")
        # llguidance reports no size; its lexer and parser tables grow with the grammar's text
        return template, BYTES_PER_GRAMMAR_CHAR * len(grammar)

    def _tokenizer(self) -> Any:
        """Built on the first compile (it walks the whole vocabulary)."""
        with self._init_lock:
            if self._lltok is None:
                import llguidance

                tok = self.tokenizer
                self._stops = stop_ids(tok)
                try:
                    self._lltok = llguidance.LLTokenizer(tokenizer_json(tok.tokenizer), n_vocab=tok.vocab_size,
                                                         eos_token=self._stops)
                except ValueError as exc:  # e.g. "can't determine decoder type: ... Fuse"
                    raise ConstraintError("structured", "structured output: the llguidance backend cannot read "
                                          f"this model's tokenizer ({trim(str(exc))}); use "
                                          "structured_output.backend: xgrammar") from None
            return self._lltok


def _grammar_text(llguidance, spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for ``spec``."""
    kind = spec.kind
    layout = FLEXIBLE if spec.whitespace_flexible else COMPACT
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.schema_text, overrides=layout)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=layout)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            # one terminal (a lexeme the lexer matches), not an alternation of rules: 4,096 alternatives
            # as rules put 4,097 items in one parser row, past llguidance's max_items_in_row (2,000)
            lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.grammar))
    except Exception as exc:  # noqa: BLE001 - ValueError, GbnfToLarkError: the grammar text is bad
        raise ConstraintError(kind, f"structured output {kind}: llguidance cannot read it: {trim(str(exc))}") from None


class LLGuidanceMatcher(Matcher):
    """One ``llguidance.LLMatcher``. A token is validated before it is consumed: consuming a
    forbidden one would put the matcher into its error state for good. EOS is kept here, not
    consumed by llguidance (whose state after rolling an EOS back differs from before it)."""

    def __init__(self, matcher: Any, vocab_size: int, stops: list[int]) -> None:
        self._m = matcher
        self._vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)
        self._stops = stops
        self._accepted = 0
        self._terminated = False

    def accept(self, token: int) -> bool:
        token = int(token)
        if not 0 <= token < self._vocab_size or self._terminated:
            return False
        if token in self._stops:  # validate_tokens() counts EOS as never valid; is_accepting() decides
            self._terminated = bool(self._m.is_accepting())
            self._accepted += self._terminated
            return self._terminated
        if self._m.validate_tokens([token]) != 1 or not self._m.consume_token(token):
            self._raise_if_error()
            return False
        self._accepted += 1
        return True

    def fill_mask(self, row: torch.Tensor) -> None:
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous() \
                or row.numel() != self._words:
            raise ValueError(f"fill_mask: expected a contiguous int32 CPU row of {self._words} words, got "
                             f"{row.dtype} on {row.device} with {row.numel()} words")
        if self._terminated:  # nothing may follow; keep the row drawable (EOS only)
            allow_only(row, self._stops)
            return
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self._raise_if_error()

    def _raise_if_error(self) -> None:
        """llguidance stops for good at one of its parser limits (items per row, lexer states); say
        so, instead of leaving a mask of EOS alone or a refused token that reads as divergence."""
        if self._m.is_error():
            message = trim((self._m.get_error() or "").split("<state>")[0])
            raise ConstraintError("structured", f"structured output: llguidance stopped at one of its "
                                  f"parser limits: {message}")

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"rollback({num_tokens}): the matcher has accepted {self._accepted} tokens")
        if num_tokens and self._terminated:
            self._terminated = False
            self._accepted -= 1
            num_tokens -= 1
        if num_tokens:
            self._m.rollback(num_tokens)
            self._accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self._terminated

    def fork(self) -> LLGuidanceMatcher:
        copy = LLGuidanceMatcher(self._m.deep_copy(), self._vocab_size, self._stops)
        copy._accepted, copy._terminated = self._accepted, self._terminated
        return copy

    def is_complete(self) -> bool:
        return self._terminated or bool(self._m.is_accepting())
