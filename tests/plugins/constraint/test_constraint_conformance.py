"""The first-party constraint backends through the conformance suite
(``lmplug.testing.ConstraintConformance``), on the suite's byte-level BPE and on a
SentencePiece-style byte-fallback vocabulary as llama.cpp stores it in a GGUF."""

from __future__ import annotations

import pytest
from support.gguf_fixtures import train_sentencepiece_like

from lmplug.interfaces.constraint import ConstraintTokenizer
from lmplug.loading.gguf_vocab import build_backend
from lmplug.testing import ConstraintConformance


def byte_fallback_tokenizer() -> ConstraintTokenizer:
    """Llama-2 style: Metaspace pieces, <0xNN> byte tokens, </s> (id 2) a control token."""
    tokens, scores, types = train_sentencepiece_like()
    backend, _ = build_backend({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                                "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
                                "tokenizer.ggml.unknown_token_id": 0}, "spm-test")
    return ConstraintTokenizer(backend, len(tokens) + 3, frozenset({2}))


class TestXGrammar(ConstraintConformance):
    backend = "xgrammar"


class TestLLGuidance(ConstraintConformance):
    backend = "llguidance"


class TestXGrammarByteFallback(ConstraintConformance):
    backend = "xgrammar"

    @pytest.fixture(scope="class")
    @classmethod
    def constraint_tokenizer(cls):
        return byte_fallback_tokenizer()


class TestLLGuidanceByteFallback(ConstraintConformance):
    backend = "llguidance"

    @pytest.fixture(scope="class")
    @classmethod
    def constraint_tokenizer(cls):
        return byte_fallback_tokenizer()
