"""Edge cases of the first-party constraint backends that the conformance suite does not pin down:
xgrammar's repairs (UTF-8, control characters, control tokens), user-defined added tokens, the
compile time limit, error messages, and the suite on the demo model's real tokenizer (slow)."""

from __future__ import annotations

import random
import re

import pytest
from lmplug_constraint.llguidance_backend import LLGuidanceBackend
from lmplug_constraint.vocab import BYTE_ALPHABET
from lmplug_constraint.xgrammar_backend import XGrammarBackend
from tokenizers import AddedToken

from lmplug.interfaces.constraint import (
    ConstraintError,
    ConstraintOptions,
    ConstraintTokenizer,
    StructuredOutput,
)
from lmplug.testing import ConstraintConformance
from lmplug.testing.constraint_walk import Vocab, allowed_ids, tiny_tokenizer, walk

BACKENDS = [XGrammarBackend, LLGuidanceBackend]


@pytest.fixture(scope="module")
def tok() -> ConstraintTokenizer:
    return tiny_tokenizer()


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_walks_decode_to_valid_utf8(cls, tok):
    """Byte tokens can spell surrogates (ED A0..BF ..); no walk may decode to U+FFFD."""
    backend, vocab = cls(ConstraintOptions(), tok), Vocab(tok)
    rng = random.Random(3)
    for spec in (StructuredOutput(regex="[^a]{1,4}"), StructuredOutput(json={"type": "string"})):
        compiled = backend.compile_cached(spec)
        for i in range(25):
            text = vocab.decode(walk(backend, compiled, vocab, rng, 300, f"{spec.kind} walk {i}", closing='"'))
            assert "\ufffd" not in text, (spec, text)
            if spec.regex:
                assert re.fullmatch(spec.regex, text), text


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_no_surrogate_after_ed(cls, tok):
    """After byte ED only 80..9F may follow (ED A0..BF starts a surrogate, which is not UTF-8)."""
    backend = cls(ConstraintOptions(), tok)
    byte = {b: tok.tokenizer.token_to_id(BYTE_ALPHABET[b]) for b in (0xED, 0x85, 0xB4)}
    for spec in (StructuredOutput(regex="[^a]{1,4}"), StructuredOutput(json={"type": "string"})):
        matcher = backend.matcher(backend.compile_cached(spec))
        if spec.json:
            assert matcher.accept(tok.tokenizer.token_to_id('"'))
        assert matcher.accept(byte[0xED])
        allowed = allowed_ids(matcher, tok.vocab_size)
        assert byte[0x85] in allowed and byte[0xB4] not in allowed, spec
        assert not matcher.accept(byte[0xB4]) and matcher.accept(byte[0x85])


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_length_bounded_json_string_has_no_raw_control_characters(cls, tok):
    backend, vocab = cls(ConstraintOptions(), tok), Vocab(tok)
    matcher = backend.matcher(backend.compile_cached(StructuredOutput(json={"type": "string", "maxLength": 5})))
    assert matcher.accept(vocab.encode('"')[0])
    allowed = set(allowed_ids(matcher, tok.vocab_size))
    raw_control = {t for t in range(vocab.size) if any(ord(c) < 0x20 for c in vocab.piece(t))}
    assert raw_control and not allowed & raw_control
    assert vocab.encode("x")[0] in allowed


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_user_defined_added_token_is_text(cls):
    """A non-special added token of a byte-level vocabulary (raw text, not byte-alphabet spelling)
    is allowed where its text is, and accepted."""
    base = tiny_tokenizer()
    base.tokenizer.add_tokens([AddedToken(" hello world", special=False, normalized=False)])
    size = base.tokenizer.get_vocab_size(with_added_tokens=True)
    tok = ConstraintTokenizer(base.tokenizer, size + 2, base.eos_token_ids)
    added = base.tokenizer.token_to_id(" hello world")
    backend = cls(ConstraintOptions(), tok)
    matcher = backend.matcher(backend.compile_cached(StructuredOutput(regex="( hello world)+")))
    assert added in allowed_ids(matcher, tok.vocab_size)
    assert matcher.accept(added) and matcher.is_complete()


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_slow_compile_is_refused(cls, tok):
    backend = cls(ConstraintOptions(max_compile_s=1e-9), tok)
    with pytest.raises(ConstraintError, match="max_compile_s") as info:
        backend.compile_cached(StructuredOutput(json={"type": "object", "properties": {
            f"p{i}": {"type": "array", "items": {"type": "integer", "minimum": i}} for i in range(40)}}))
    assert info.value.field == "json"


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_error_names_field_and_problem(cls, tok):
    backend = cls(ConstraintOptions(), tok)
    with pytest.raises(ConstraintError) as info:
        backend.compile_cached(StructuredOutput(regex="a(b"))
    message = str(info.value)
    assert info.value.field == "regex" and cls.name in message and "regex" in message
    assert "/project/" not in message and "\n" not in message  # the engine's message, trimmed


def test_auto_prefers_xgrammar():
    assert XGrammarBackend.capabilities.priority > LLGuidanceBackend.capabilities.priority


def test_property_order_is_the_schema_order(tok):
    """Engines emit properties in schema order, so the compiled schema must keep the user's order."""
    spec = StructuredOutput(json={"type": "object", "properties": {"zeta": {"type": "integer"},
                                  "alpha": {"type": "integer"}}, "required": ["zeta", "alpha"]})
    vocab = Vocab(tok)
    for cls in BACKENDS:
        backend = cls(ConstraintOptions(), tok)
        matcher = backend.matcher(backend.compile_cached(spec))
        assert all(matcher.accept(t) for t in vocab.encode('{"zeta": 1, "alpha": 2}')), cls.name
        assert matcher.is_complete()


def demo_tokenizer(demo_gguf) -> ConstraintTokenizer:
    from lmplug.loading.gguf import load_gguf

    source = load_gguf(demo_gguf)
    tokenizer = source.tokenizer
    return ConstraintTokenizer(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids)


@pytest.mark.slow
class TestXGrammarDemoTokenizer(ConstraintConformance):
    """SmolLM2's byte-level BPE (49152 tokens) as the demo GGUF stores it."""

    backend = "xgrammar"
    walks = 3

    @pytest.fixture(scope="class")
    @classmethod
    def constraint_tokenizer(cls, demo_gguf):
        return demo_tokenizer(demo_gguf)


@pytest.mark.slow
class TestLLGuidanceDemoTokenizer(ConstraintConformance):
    backend = "llguidance"
    walks = 3

    @pytest.fixture(scope="class")
    @classmethod
    def constraint_tokenizer(cls, demo_gguf):
        return demo_tokenizer(demo_gguf)
