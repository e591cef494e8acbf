"""The ``xgrammar`` constraint backend: structured output with XGrammar's grammar engine.

XGrammar precomputes, per grammar, which tokens each parser state allows, so one mask costs
microseconds for most states; the default backend (``auto`` picks it before llguidance).

The tokenizer: xgrammar needs every token's encoded text and how to decode it (byte-level,
byte-fallback or raw). The kind and ``add_prefix_space`` come from xgrammar's own reading of the
tokenizer (``TokenizerInfo.from_huggingface`` on a ``PreTrainedTokenizerFast`` wrapping it); the
vocabulary handed over is ours, built so that control tokens are blank (xgrammar treats blank
tokens as special: never allowed, EOS apart) and user-defined added tokens of a byte-level
vocabulary are spelled in its byte alphabet (their raw text is not). Ids past the tokenizer's
vocabulary are blank too.

Two repairs of xgrammar 0.2.9's output: it lets bytes that are not UTF-8 (surrogates) through,
so every matcher also applies a ``Utf8Guard``; and the character class it writes for strings
with ``minLength``/``maxLength`` lacks the control characters JSON forbids raw, so the JSON
grammar's text is patched (``LENGTH_BOUNDED_CLASS``) before it is compiled.

JSON: strict mode (xgrammar's default: no properties or items the schema does not name);
``whitespace_flexible`` is xgrammar's ``any_whitespace``, otherwise separators ``", "`` and
``": "``. ``choice`` is an EBNF alternation of the strings as JSON-escaped literals;
``grammar`` is GBNF with root rule ``root``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
from lmplug_constraint.limits import compile_within
from lmplug_constraint.utf8 import Utf8Guard
from lmplug_constraint.vocab import (
    allow_only,
    byte_level_spelling,
    special_ids,
    stop_ids,
    tokenizer_size,
)

from lmplug.api import (
    Capabilities,
    ConstraintBackend,
    ConstraintOptions,
    Matcher,
    StructuredOutput,
    bitmask_words,
)

SEPARATORS = (", ", ": ")
# xgrammar's character class for length-bounded JSON strings, and the same without control characters
LENGTH_BOUNDED_CLASS = r'[^\"\\\r\n]'
JSON_STRING_CLASS = r'[^\0-\x1f\"\\\r\n]'


class XGrammarBackend(ConstraintBackend):
    name = "xgrammar"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), priority=20)
    Options = ConstraintOptions

    def __init__(self, options: ConstraintOptions, tokenizer) -> None:
        super().__init__(options, tokenizer)
        self._compiler: Any = None
        self._init_lock = threading.Lock()
        self._stops: list[int] = []
        self._refused: frozenset[int] = frozenset()
        self._guard: Utf8Guard | None = None

    def compile(self, spec: StructuredOutput) -> Any:
        compiler = self._grammar_compiler()
        kind = spec.kind
        if kind in ("json", "json_object"):
            schema = spec.schema_text if kind == "json" else '{"type": "object"}'
            build = lambda: self._compile_json(compiler, schema, spec)
        elif kind == "regex":
            build = lambda: compiler.compile_regex(spec.regex)
        elif kind == "choice":
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            build = lambda: compiler.compile_grammar(ebnf)
        else:
            build = lambda: compiler.compile_grammar(spec.grammar)
        return compile_within(self.options.max_compile_s, kind, self.name, build)

    def prepare(self) -> None:
        self._grammar_compiler()

    def size_bytes(self, compiled: Any) -> int:
        return int(compiled.memory_size_bytes)  # xgrammar's own count: the grammar and its token masks

    def matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(compiled, self.tokenizer.vocab_size, self._stops, self._refused, self._guard)

    def _compile_json(self, compiler: Any, schema: str, spec: StructuredOutput) -> Any:
        import xgrammar as xgr

        grammar = xgr.Grammar.from_json_schema(schema, **self._json_layout(spec))
        text = str(grammar)
        if LENGTH_BOUNDED_CLASS not in text:
            return compiler.compile_grammar(grammar)
        return compiler.compile_grammar(text.replace(LENGTH_BOUNDED_CLASS, JSON_STRING_CLASS))

    @staticmethod
    def _json_layout(spec: StructuredOutput) -> dict:
        if spec.whitespace_flexible:
            return {"any_whitespace": True}
        return {"any_whitespace": False, "separators": SEPARATORS}

    def _grammar_compiler(self) -> Any:
        """Built on the first compile: importing xgrammar and reading the vocabulary take seconds."""
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = self._tokenizer_info(xgr)
                # our LRU (compile_cached) is the cache; xgrammar's own would grow without bound
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _tokenizer_info(self, xgr) -> Any:
        from transformers import PreTrainedTokenizerFast

        tok = self.tokenizer
        backend = tok.tokenizer
        self._stops = stop_ids(tok)
        detected = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=backend), vocab_size=tok.vocab_size,
            stop_token_ids=self._stops)
        byte_level = detected.vocab_type == xgr.VocabType.BYTE_LEVEL
        specials = special_ids(backend)
        added = backend.get_added_tokens_decoder()
        encoded = [""] * tok.vocab_size
        for i in range(min(tokenizer_size(backend), tok.vocab_size)):
            if i in specials:
                continue
            text = backend.id_to_token(i)
            if i in added and byte_level:
                text = byte_level_spelling(added[i].content)
            encoded[i] = text or ""
        info = xgr.TokenizerInfo(encoded, vocab_type=detected.vocab_type, vocab_size=tok.vocab_size,
                                 stop_token_ids=self._stops, add_prefix_space=detected.add_prefix_space)
        # refused before xgrammar sees them (it would log a warning for each)
        self._refused = frozenset(info.special_token_ids) - set(self._stops)
        self._guard = Utf8Guard(list(info.decoded_vocab), bitmask_words(tok.vocab_size))
        return info


class XGrammarMatcher(Matcher):
    """One ``xgr.GrammarMatcher`` plus the unfinished UTF-8 character after each accepted token
    (``_pending``; rollback pops it). Rollback is unlimited: xgrammar's Earley parser keeps history."""

    def __init__(self, compiled: Any, vocab_size: int, stops: list[int], refused: frozenset[int],
                 guard: Utf8Guard) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._stops = stops
        self._refused = refused
        self._guard = guard
        self._pending = [b""]

    def accept(self, token: int) -> bool:
        token = int(token)
        if not 0 <= token < self._vocab_size or token in self._refused:
            return False
        if not self._guard.allows(self._pending[-1], token) or not self._m.accept_token(token):
            return False
        self._pending.append(self._guard.advance(self._pending[-1], token))
        return True

    def fill_mask(self, row: torch.Tensor) -> None:
        if self._m.is_terminated():  # nothing may follow; keep the row drawable (EOS only)
            allow_only(row, self._stops)
            return
        self._m.fill_next_token_bitmask(row.view(1, -1), 0)
        row &= self._guard.words_after(self._pending[-1])

    def rollback(self, num_tokens: int) -> None:
        accepted = len(self._pending) - 1
        if not 0 <= num_tokens <= accepted:
            raise ValueError(f"rollback({num_tokens}): the matcher has accepted {accepted} tokens")
        if num_tokens:
            self._m.rollback(num_tokens)
            del self._pending[-num_tokens:]

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def fork(self) -> XGrammarMatcher:
        copy = XGrammarMatcher.__new__(XGrammarMatcher)
        copy.__dict__.update(self.__dict__)
        copy._m, copy._pending = self._m.fork(), list(self._pending)
        return copy

    def is_complete(self) -> bool:
        return bool(self._m.is_completed()) or self.is_terminated()
