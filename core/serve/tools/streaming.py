"""What every tool-call parser shares: the deltas a stream yields and the scanning machinery.

A parser is written once, as a streamer: it is fed the output as it grows and decides, as early
as the text allows, which parts are content and which are calls; ``parse(text)`` is the same
streamer fed the whole text at once. So a stream and a parse of the same text cannot disagree:
the tests check that feeding the text split anywhere gives the same result.

Two rules keep a stream from ever taking anything back:

- text that may still be the start of a marker (``<tool_`` before ``<tool_call>``) is held until
  it is or is not one; everything else that is plainly content goes out at once;
- a call goes out only once it is complete and valid (its JSON closed and parsed), so a call cut
  off by ``max_tokens`` or written with broken JSON comes back as content, as ``parse`` says.
  A call's arguments therefore arrive in one fragment, after its header.

Content is stripped as ``parse`` strips it: leading whitespace is dropped and whitespace is held
until more content follows it (at the end it is dropped).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmplug.serve.tools.definitions import compact_json, new_call_id, strict_loads
from lmplug.serve.tools.validate import CallCheck

_SPACE = re.compile(r"\s*")
_CLOSERS = {"]": "[", "}": "{"}


@dataclass
class ToolDelta:
    """One piece of a stream: content text, or a piece of call ``index`` (the first piece of a
    call carries its ``id`` and ``name``, the next its ``arguments``)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def call_parts(value: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, compact arguments) of a call object ``{"name": ..., <key>: {...}}``, or None when it
    is not one. Arguments given as JSON text of an object are accepted; absent or null means ``{}``."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = next((value[k] for k in keys if k in value), None)
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = strict_loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return value["name"], compact_json(args)


def loads_or_none(text: str) -> Any:
    try:
        return strict_loads(text)
    except ValueError:
        return None


class JsonSpan:
    """Finds where the JSON object or array opening at ``start`` closes, fed a growing text.

    Only brackets and strings are tracked (the text is parsed once closed); a bracket closed by
    the wrong kind ends the span at once, broken, so a bad call is given up as early as possible.
    """

    _OUTSIDE = re.compile(r'[\[\]{}"]')
    _INSIDE = re.compile(r'["\\]')

    def __init__(self, start: int) -> None:
        self.start = start
        self.end: int | None = None
        self.broken = False
        self._pos = start
        self._stack: list[str] = []
        self._in_string = False

    def scan(self, text: str) -> bool:
        """Advance over ``text``; True once the span is closed (``end`` set) or broken."""
        while self.end is None:
            if self._in_string:
                m = self._INSIDE.search(text, self._pos)
                if m is None or (m.group() == "\\" and m.end() >= len(text)):
                    self._pos = len(text) if m is None else m.start()
                    return False
                self._pos = m.end() + (1 if m.group() == "\\" else 0)
                self._in_string = m.group() == "\\"
                continue
            m = self._OUTSIDE.search(text, self._pos)
            if m is None:
                self._pos = len(text)
                return False
            c, self._pos = m.group(), m.end()
            if c == '"':
                self._in_string = True
            elif c in "[{":
                self._stack.append(c)
            elif not self._stack or self._stack.pop() != _CLOSERS[c]:
                self.end, self.broken = self._pos, True
            elif not self._stack:
                self.end = self._pos
        return True


class ToolStreamer(ABC):
    """Turns a growing output into content and call deltas; one per generated sequence.

    Subclasses implement ``_scan(final)``: look at ``self._text`` from ``self._pos`` (everything
    before it is decided), emit with ``_content_to`` / ``_call`` and return when the rest cannot
    be decided yet (with ``final``, decide everything). ``_idle`` says no offsets into the text
    are held, so the decided text may be dropped.

    ``tools``: the request's declared tools. Only a call to one of them whose arguments validate
    against its schema goes out as a call (``_call`` enforces it, so no parser can forget);
    anything else is content, marker included. With no tools, no text is a call.
    """

    def __init__(self, tools: Sequence[dict] | None = None) -> None:
        self._check = CallCheck(tools)
        self._text = ""
        self._pos = 0
        self._out: list[ToolDelta] = []
        self._pending = ""
        self._started = False
        self._calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[ToolDelta]:
        """The deltas that ``delta`` (the next piece of output text) makes certain."""
        if self._finished:
            raise RuntimeError("ToolStreamer.feed after finish")
        if self._idle and self._pos:
            self._text, self._pos = self._text[self._pos:], 0
        self._text += delta
        self._scan(final=False)
        return self._take()

    def finish(self) -> list[ToolDelta]:
        """The output is complete: decide what was held back."""
        if not self._finished:
            self._finished = True
            self._scan(final=True)
        return self._take()

    @property
    @abstractmethod
    def _idle(self) -> bool: ...

    @abstractmethod
    def _scan(self, final: bool) -> None: ...

    # -- helpers for subclasses ------------------------------------------------------------

    def _content_to(self, end: int) -> None:
        """``text[pos:end]`` is content."""
        piece, self._pos = self._text[self._pos:end], end
        if not self._started:
            piece = piece.lstrip()
            if not piece:
                return
            self._started = True
        self._pending += piece
        body = self._pending.rstrip()
        if body:
            self._out.append(ToolDelta(content=body))
            self._pending = self._pending[len(body):]

    def _accepts(self, name: str, arguments: str) -> bool:
        """Whether a well-formed call may go out as one (declared, its arguments valid)."""
        return self._check.accepts(name, arguments)

    def _call(self, name: str, arguments: str, end: int) -> None:
        """``text[pos:end]`` is a call, if the request declared it and its arguments validate;
        else it is content."""
        if not self._accepts(name, arguments):
            self._content_to(end)
            return
        index, self._pos = self._calls, end
        self._calls += 1
        self._out.append(ToolDelta(index=index, id=new_call_id(), name=name))
        self._out.append(ToolDelta(index=index, arguments=arguments))

    def _content_until_marker(self, marker: str, final: bool) -> bool:
        """Emit content up to the next ``marker``; True with ``pos`` at the marker when one is
        found, else False, holding back a tail that may still begin the marker (none if final)."""
        at = self._text.find(marker, self._pos)
        if at >= 0:
            self._content_to(at)
            return True
        end = len(self._text)
        if not final:
            end -= held_prefix(self._text, self._pos, marker)
        self._content_to(end)
        return False

    def _take(self) -> list[ToolDelta]:
        out, self._out = self._out, []
        merged: list[ToolDelta] = []
        for d in out:
            if d.content is not None and merged and merged[-1].content is not None:
                merged[-1].content += d.content
            else:
                merged.append(d)
        return merged


def held_prefix(text: str, pos: int, marker: str) -> int:
    """Length of the longest tail of ``text[pos:]`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
