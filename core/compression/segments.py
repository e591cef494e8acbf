"""A prompt cut into segments for compression: what is protected, and the checks on the texts.

``split_text`` marks a text's last paragraph (the final question) and every occurrence of each
``protect`` string as protected, the rest as compressible; ``occurrences`` finds overlapping
occurrences in linear time (a hostile prompt cannot make it quadratic). The size and ``protect``
checks name the field a request got wrong. Pure functions of strings: no model, no engine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from lmplug.errors import ConfigError
from lmplug.interfaces.compressor import Segment

MAX_COMPRESS_CHARS = 1 << 20  # characters of prompt (all message contents) one request may compress
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def split_text(text: str, protect: Sequence[str], final_question: bool = True) -> list[Segment]:
    """``text`` as segments: its last paragraph (when ``final_question``) and every occurrence of
    each ``protect`` string protected, the rest not."""
    marks = [False] * len(text)
    if final_question:
        last = _last_blank_line(text)
        for k in range(last.start() if last else 0, len(text)):  # with the blank line before it
            marks[k] = True
    for span in protect:
        covered = 0  # each character is marked once: linear, however the occurrences overlap
        for start in occurrences(text, span):
            end = start + len(span)
            if end > covered:
                first = max(start, covered)
                marks[first:end] = [True] * (end - first)
                covered = end
    return [Segment(text[a:b], flag) for flag, a, b in _runs(marks)]


def occurrences(text: str, span: str) -> list[int]:
    """Every start of ``span`` in ``text``, overlapping ones included, in O(len(text) + len(span)).

    ``str.find`` from each start + 1 costs len(span) per overlapping occurrence: 128k ``a`` with a
    64k ``a`` span was 64k x 64k steps. The Z-algorithm on ``span + text`` gives, at each text
    position, how far it agrees with ``span``; a span occurs where that is at least its length.
    """
    if not span or len(span) > len(text):
        return []
    if span[0] not in span[1:]:  # no two occurrences overlap, so find's cost is linear (and in C)
        found, at = [], text.find(span)
        while at >= 0:
            found.append(at)
            at = text.find(span, at + len(span))
        return found
    whole, n = span + text, len(span)
    z, left, right, found = [0] * len(whole), 0, 0, []
    for i in range(1, len(whole)):
        k = min(right - i, z[i - left]) if i < right else 0
        while i + k < len(whole) and whole[k] == whole[i + k] and k < n:
            k += 1
        z[i] = k
        if i + k > right:
            left, right = i, i + k
        if i >= n and k >= n:
            found.append(i - n)
    return found


def final_paragraph(text: str) -> str | None:
    """The final question ``split_text`` protects: the text's last paragraph, stripped."""
    last = _last_blank_line(text)
    return text[last.end() if last else 0:].strip() or None


def _last_blank_line(text: str) -> re.Match | None:
    """The blank line before ``text``'s last paragraph (trailing whitespace is not one)."""
    breaks = list(_BLANK_LINE.finditer(text.rstrip()))
    return breaks[-1] if breaks else None


def _runs(marks: list[bool]) -> list[tuple[bool, int, int]]:
    runs, start = [], 0
    for k in range(1, len(marks) + 1):
        if k == len(marks) or marks[k] != marks[start]:
            runs.append((marks[start], start, k))
            start = k
    return runs


def check_size(texts: Sequence[str]) -> None:
    size = sum(len(t) for t in texts)
    if size > MAX_COMPRESS_CHARS:
        raise ConfigError(f"compression: a prompt of {size} characters; at most {MAX_COMPRESS_CHARS} can be "
                          "compressed (send it without compression, or shorter)")


def check_protect(protect: Sequence[str], texts: Sequence[str]) -> None:
    for span in protect:
        if not any(span in t for t in texts):
            shown = span if len(span) <= 60 else span[:57] + "..."
            raise ConfigError(f"compression.protect: {shown!r} does not occur in the prompt")
