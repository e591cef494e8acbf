"""Tool-call parsers: the formats models write calls in when the output is free (``tool_choice``
``auto``), read after generation (``parse``) or while streaming (``streamer``).

- ``hermes``: Qwen2.5, Qwen3, Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  any number of them; a last block left open at the end still counts if its JSON is complete.
- ``llama3``: Llama 3.1-3.3 JSON calls: the output starts with ``{"name": ..., "parameters": {...}}``
  (or has ``<|python_tag|>`` before it), several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` (one marker per call). ``[TOOL_CALLS]`` is a special token:
  the output must be detokenized with special tokens kept for it to be seen.

Text inside a marker that is not a valid call (broken JSON, no name, cut off) is content, marker
included; parsing never raises. ``parser_for("auto", template)`` picks by the markers the chat
template writes and defaults to ``hermes``, the format most open models with tool use share.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from lmplug.serve.tools.definitions import ToolCall, ToolError
from lmplug.serve.tools.streaming import (
    JsonSpan,
    ToolStreamer,
    call_parts,
    loads_or_none,
    skip_space,
)


class ToolParser(ABC):
    """One tool-call format. ``parse`` and ``streamer`` share one implementation (the streamer),
    so joining a stream's deltas always gives what ``parse`` returns for the full text."""

    name: ClassVar[str]
    # its markers are special tokens of the models that use it: the output must be detokenized
    # with them (``SamplingParams.skip_special_tokens=False``) or the parser never sees a call
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def streamer(self, tools: Sequence[dict] | None) -> ToolStreamer:
        """A fresh streamer for one sequence of a request that declared ``tools`` (normalized by
        ``check_tools``): only calls to them with valid arguments are calls."""

    def parse(self, text: str, tools: Sequence[dict] | None) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls, stripped, None if empty; the calls in order)."""
        s = self.streamer(tools)
        deltas = s.feed(text) + s.finish()
        content = "".join(d.content for d in deltas if d.content is not None)
        heads = {d.index: d for d in deltas if d.id is not None}
        args: dict[int, str] = {}
        for d in deltas:
            if d.arguments is not None:
                args[d.index] = args.get(d.index, "") + d.arguments
        calls = [ToolCall(h.id, h.name, args.get(i, "")) for i, h in sorted(heads.items())]
        return content or None, calls


# -- hermes ---------------------------------------------------------------------------------


class _HermesStreamer(ToolStreamer):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: Sequence[dict] | None) -> None:
        super().__init__(tools)
        self._in_call = False
        self._search = 0

    @property
    def _idle(self) -> bool:
        return not self._in_call

    def _scan(self, final: bool) -> None:
        while True:
            if not self._in_call:
                if not self._content_until_marker(self.OPEN, final):
                    return
                self._in_call, self._search = True, self._pos + len(self.OPEN)
                continue
            body = self._pos + len(self.OPEN)
            close = self._text.find(self.CLOSE, self._search)
            if close < 0:
                if not final:
                    self._search = max(body, len(self._text) - len(self.CLOSE) + 1)
                    return
                close = end = len(self._text)
            else:
                end = close + len(self.CLOSE)
            self._in_call = False
            parts = call_parts(loads_or_none(self._text[body:close]))
            if parts:
                self._call(*parts, end)
            else:
                self._content_to(body)  # the marker is text; what follows is scanned again


class HermesParser(ToolParser):
    name = "hermes"

    def streamer(self, tools: Sequence[dict] | None) -> ToolStreamer:
        return _HermesStreamer(tools)


# -- llama3 ---------------------------------------------------------------------------------


class _Llama3Streamer(ToolStreamer):
    TAG = "<|python_tag|>"

    def __init__(self, tools: Sequence[dict] | None) -> None:
        super().__init__(tools)
        self._state = "start"
        self._span: JsonSpan | None = None

    @property
    def _idle(self) -> bool:
        return self._state in ("start", "content")

    def _scan(self, final: bool) -> None:
        text = self._text
        while True:
            state = self._state
            if state == "start":
                # Calls are recognised only where the output starts with "{" or the tag (after
                # whitespace), or after a tag following content; a "{" later on is content.
                first = skip_space(text, self._pos)
                rest = text[first:]
                if not rest or (not final and self.TAG.startswith(rest)):
                    return
                if rest.startswith(self.TAG):
                    self._pos, self._state = first + len(self.TAG), "calls"
                elif rest[0] == "{":
                    self._pos, self._state = first, "calls"
                else:
                    self._state = "content"
            elif state == "content":
                if not self._content_until_marker(self.TAG, final):
                    return
                self._pos, self._state = self._pos + len(self.TAG), "calls"
            elif state in ("calls", "after"):
                at = skip_space(text, self._pos)
                if at == len(text):
                    if final:
                        self._pos = at
                    return
                if state == "after" and text[at] == ";":
                    self._pos, self._state = at + 1, "calls"
                elif state == "calls" and text[at] == "{":
                    self._pos, self._state, self._span = at, "object", JsonSpan(at)
                else:
                    self._pos, self._state = at, "content"
            else:  # object
                span = self._span
                if not span.scan(text) and not final:
                    return
                parts = None if span.end is None or span.broken else call_parts(
                    loads_or_none(text[span.start:span.end]))
                if parts:
                    self._call(*parts, span.end)
                    self._state = "after"
                else:
                    self._state = "content"  # the object is text from its "{" on


class Llama3JsonParser(ToolParser):
    name = "llama3"

    def streamer(self, tools: Sequence[dict] | None) -> ToolStreamer:
        return _Llama3Streamer(tools)


# -- mistral --------------------------------------------------------------------------------


class _MistralStreamer(ToolStreamer):
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"[a-zA-Z0-9_-]{0,65}")

    def __init__(self, tools: Sequence[dict] | None) -> None:
        super().__init__(tools)
        self._state = "content"
        self._span: JsonSpan | None = None
        self._name_start = 0
        self._name = ""

    @property
    def _idle(self) -> bool:
        return self._state == "content"

    def _scan(self, final: bool) -> None:
        text = self._text
        while True:
            state = self._state
            if state == "content":
                if not self._content_until_marker(self.MARK, final):
                    return
                self._state = "marker"
                continue
            if state == "marker":
                at = skip_space(text, self._pos + len(self.MARK))
                if at == len(text):
                    if not final:
                        return
                    self._give_up()
                elif text[at] in "[{":
                    self._state, self._span = "list", JsonSpan(at)
                else:
                    self._state, self._name_start = "name", at
                continue
            if state == "name":
                start = self._name_start
                name = self._NAME.match(text, start).group()
                after = start + len(name)
                tail = text[after:after + len(self.ARGS)]
                obj = skip_space(text, after + len(self.ARGS))
                if not name or len(name) > 64 or not self.ARGS.startswith(tail) or (
                        tail == self.ARGS and obj < len(text) and text[obj] != "{"):
                    self._give_up()
                elif tail != self.ARGS or obj == len(text):  # the name, "[ARGS]" or "{" may follow
                    if not final:
                        return
                    self._give_up()
                else:
                    self._state, self._name, self._span = "args", name, JsonSpan(obj)
                continue
            span = self._span  # "list" or "args": wait for the JSON to close
            if not span.scan(text) and not final:
                return
            value = None if span.end is None or span.broken else loads_or_none(text[span.start:span.end])
            if state == "args":
                calls = [call_parts({"name": self._name, "arguments": value})] if isinstance(value, dict) else []
            else:
                items = value if isinstance(value, list) else [value]
                calls = [call_parts(item) for item in items] if value is not None else []
            # one list is one decision: a call in it the request may not get makes all of it text
            if calls and all(calls) and all(self._accepts(*c) for c in calls):
                for name, arguments in calls:
                    self._call(name, arguments, span.end)
                self._state = "content"
            else:
                self._give_up()

    def _give_up(self) -> None:
        """The marker starts no valid call: it is text, and what follows is scanned again."""
        self._content_to(self._pos + len(self.MARK))
        self._state = "content"


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens of Mistral's vocabularies

    def streamer(self, tools: Sequence[dict] | None) -> ToolStreamer:
        return _MistralStreamer(tools)


# -- choosing one ---------------------------------------------------------------------------

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
# Markers a chat template writes when the model uses each format, checked in this order.
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3"), ("ipython", "llama3"),
                    ("[TOOL_CALLS]", "mistral"))
DEFAULT_PARSER = "hermes"


def parser_for(option: str, chat_template: str | None) -> ToolParser | None:
    """The parser the ``tool_call_parser`` option names: ``none`` (no parsing), a format name, or
    ``auto``: the format whose marker the chat template writes, else ``hermes`` (the format most
    open tool-using models share, and the one a template without markers is likeliest to mean)."""
    if option == "none":
        return None
    if option == "auto":
        template = chat_template or ""
        return PARSERS[next((name for marker, name in TEMPLATE_MARKERS if marker in template), DEFAULT_PARSER)]()
    if isinstance(option, str) and option in PARSERS:
        return PARSERS[option]()
    raise ToolError("tool_call_parser", f"tool_call_parser: expected one of auto, none, "
                    f"{', '.join(PARSERS)}; got {option!r}")
