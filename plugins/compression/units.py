"""Splitting text into the units the methods keep or drop. Every splitter returns pieces that
join to the text exactly (whitespace stays attached to the piece before it), so dropping pieces
never alters the ones kept."""

from __future__ import annotations

import re
from collections.abc import Sequence

from lmplug.api import CompressionInput, CompressionResult, Segment

_WORDS = re.compile(r"\s*\S+\s*|\s+")
_PHRASES = re.compile(r".*?(?:[.!?;:,]+(?=\s|$)\s*|\n\s*|$)", re.DOTALL)
_SENTENCES = re.compile(r".*?(?:[.!?]+(?=\s|$)\s*|\n\s*|$)", re.DOTALL)
_PARAGRAPHS = re.compile(r".*?(?:\n[ \t]*\n\s*|$)", re.DOTALL)


def _split(pattern: re.Pattern, text: str) -> list[str]:
    return [m.group(0) for m in pattern.finditer(text) if m.group(0)]


def words(text: str) -> list[str]:
    return _split(_WORDS, text)


def phrases(text: str) -> list[str]:
    """Clauses ending at punctuation followed by space, or at a line break."""
    return _split(_PHRASES, text)


def sentences(text: str) -> list[str]:
    return _split(_SENTENCES, text)


def paragraphs(text: str) -> list[str]:
    """Blocks separated by a blank line (the blank line stays with the block before it)."""
    return _split(_PARAGRAPHS, text)


def assemble(request: CompressionInput, kept: Sequence[str | None]) -> CompressionResult:
    """The result from one new text per segment (None for protected ones, which are copied)."""
    out = tuple(s if s.protected else Segment(text) for s, text in zip(request.segments, kept))
    count = request.count_tokens
    before = sum(count(s.text) for s in request.segments if not s.protected)
    after = sum(count(s.text) for s in out if not s.protected)
    return CompressionResult(out, before, after)
