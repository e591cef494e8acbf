"""Chat templates, rendered within limits, and conversations tokenized without forged turns.

Chat templates ship with downloaded models, so they run in jinja's immutable sandbox with
bounds on time and size: string and list repetition, ``+``, ``~``, ``%``, ``**``, string
methods and the filters that grow text are checked before they allocate, every loop and
call ticks a deadline, and the rendered text is capped. A template past a limit raises
:class:`ChatTemplateError` naming the template, never a ``MemoryError``.

:class:`ChatEncoder` tokenizes a conversation so that special-token text inside message
content (``"<|im_end|><|im_start|>system"`` typed by a user) stays plain text; only the
special tokens the template itself wrote become special ids.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from lmplug.errors import LmplugError

MAX_CHARS = 4 << 20  # the rendered text, and any one string or list built on the way
MAX_INT_BITS = 4096
TIME_LIMIT_S = 5.0


class ChatTemplateError(LmplugError, ValueError):
    """The chat template rejected the conversation, or went past a limit."""


class _Budget:
    def __init__(self, name: str, limit: int, seconds: float) -> None:
        self.name, self.limit, self.deadline = name, limit, time.monotonic() + seconds
        self.seconds = seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template of {self.name!r}: rendering took over "
                                    f"{self.seconds:g} s")

    def size(self, n: int, what: str) -> None:
        if n > self.limit:
            raise ChatTemplateError(f"chat template of {self.name!r}: {what} of {n} items or "
                                    f"more, over the limit of {self.limit}")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("lmplug_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # rendered outside render(): the defaults still hold
        budget = _Budget("?", MAX_CHARS, TIME_LIMIT_S)
        _BUDGET.set(budget)
    budget.tick()
    return budget


def _sized(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)):
        _BUDGET.get() and _budget().size(len(value), "a value")
    return value


_FORMAT_NUMBER = re.compile(r"\d+")


def _check_format_string(fmt: Any) -> None:
    if isinstance(fmt, str):
        for number in _FORMAT_NUMBER.findall(fmt):
            if len(number) > 7 or int(number) > _budget().limit:
                _budget().size(int(number), "a format width")
        if "*" in fmt and "%" in fmt:
            raise ChatTemplateError("chat template: '*' widths in %-formatting are not allowed")


class _LimitedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:  # `a ~ b`: checked join
        self.write("environment.lmplug_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%", "//", "/", "-"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):  # every loop ticks the deadline
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("lmplug_iter"), [loop.iter], [], None, None)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    budget.size(len(seq) * max(n, 0), "a repeated string or list")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            budget.size(len(left) + len(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_format_string(left)
        if isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() * (abs(right) if operator == "**" else 1) + right.bit_length()
            if operator in ("*", "**") and bits > MAX_INT_BITS:
                raise ChatTemplateError(f"chat template of {budget.name!r}: an integer of over "
                                        f"{MAX_INT_BITS} bits")
        return _sized(super().call_binop(context, operator, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.limit:
                budget.size(abs(value), "a number argument")
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(obj, "__name__", "")
            if name in ("format", "format_map"):
                _check_format_string(owner)
            elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
                grow = max(len(args[1]) - len(args[0]), 0) * (owner.count(args[0]) if args[0] else len(owner) + 1)
                budget.size(len(owner) + grow, "a replaced string")
            elif name == "join" and args:
                budget.size(_total_length(args[0], budget), "a joined string")
            elif name == "expandtabs":
                budget.size(owner.count("\t") * (int(args[0]) if args else 8), "an expanded string")
        return _sized(super().call(context, obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget()
        return super().getitem(obj, argument)


def _total_length(items: Any, budget: _Budget) -> int:
    items = list(items) if not isinstance(items, (list, tuple)) else items
    budget.size(len(items), "a joined list")
    return sum(len(str(i)) for i in items)


def _iter(value: Any) -> Iterator[Any]:
    for item in value:
        _budget()
        yield item


def _concat(values: tuple) -> str:
    text = "".join(str(v) for v in values)
    return _sized(text)


def _filters(env: jinja2.Environment) -> None:
    base = dict(env.filters)

    def join(value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)
        _budget().size(_total_length(items, _budget()) + len(d) * len(items), "a joined string")
        return base["join"](_EvalCtx(), items, d, attribute)

    def widened(name: str) -> Callable[..., str]:
        def check(value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> str:
            lines = str(value).count("\n") + 1
            w = width if isinstance(width, int) else len(str(width))
            _budget().size(len(str(value)) + abs(w) * lines, f"the {name} filter's output")
            return base[name](value, width, *args, **kwargs)
        return check

    def fmt(value: str, *args: Any, **kwargs: Any) -> str:
        _check_format_string(value)
        return _sized(base["format"](value, *args, **kwargs))

    def replace(value: Any, old: str, new: str, count: int | None = None) -> str:
        s = str(value)
        _budget().size(len(s) + max(len(new) - len(old), 0) * (s.count(old) if old else len(s) + 1),
                       "a replaced string")
        return s.replace(old, new, -1 if count is None else count)

    env.filters.update(join=join, center=widened("center"), indent=widened("indent"),
                       format=fmt, replace=replace, tojson=_tojson)


class _EvalCtx:  # what jinja's join filter reads from its eval context
    autoescape = False


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; HF's does not, and templates rely on that.
    if isinstance(indent, int) and indent > 64:
        raise ChatTemplateError(f"chat template: tojson indent={indent} is over 64")
    return _sized(json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                             sort_keys=sort_keys))


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = _LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.lmplug_iter = _iter
    env.lmplug_concat = _concat
    _filters(env)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(template: jinja2.Template, name: str, variables: dict[str, Any], *,
           max_chars: int = MAX_CHARS, seconds: float = TIME_LIMIT_S) -> str:
    """The template's text, or :class:`ChatTemplateError` past ``max_chars`` or ``seconds``."""
    budget = _Budget(name, max_chars, seconds)
    token = _BUDGET.set(budget)
    try:
        parts, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            budget.size(size, "rendered text")
            budget.tick()
            parts.append(chunk)
        return "".join(parts)
    except (MemoryError, OverflowError, RecursionError) as exc:
        raise ChatTemplateError(f"chat template of {name!r}: {type(exc).__name__} while rendering") from None
    finally:
        _BUDGET.reset(token)


# -- tokenizing a conversation -------------------------------------------------------------------

_ESC = "\ufdd0"  # Unicode noncharacters: never in text a client means to send
_MARK = "\ufdd1"
_ESCAPED = re.compile(_ESC + r"(\d+)" + _ESC)


class ChatEncoder:
    """Token ids of rendered chats where only the template's own special tokens are special.

    Special-token text in the messages is swapped for a placeholder before rendering; in
    the rendered text each special token the template wrote becomes a marker, an added
    token of the same matching rules in a copy of the backend that encodes every special
    token as plain text (``encode_special_tokens``). One encode of that text splits where
    the plain encode would, so a conversation without special text in its messages gets
    the very same ids as ``encode(render(...))``.
    """

    def __init__(self, backend: Backend) -> None:
        added = {i: t for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.specials = sorted({t.content for t in added.values()}, key=len, reverse=True)
        self._index = {s: k for k, s in enumerate(self.specials)}
        self._pattern = re.compile("|".join(re.escape(s) for s in self.specials)) if self.specials else None
        self._text = Backend.from_str(backend.to_str())
        self._text.encode_special_tokens = True
        markers = {}
        for i, t in added.items():
            marker = f"{_MARK}{self._index[t.content]}{_MARK}"
            markers[t.content] = (marker, i)
            self._text.add_tokens([AddedToken(marker, single_word=t.single_word, lstrip=t.lstrip,
                                              rstrip=t.rstrip, normalized=False, special=False)])
        self._marker_of = {s: m for s, (m, _) in markers.items()}
        self._special_of = {self._text.token_to_id(m): i for m, i in markers.values()}

    def escape(self, value: Any) -> Any:
        """``value`` (messages, tools) with special-token text in its strings replaced."""
        if isinstance(value, str):
            if _ESC in value or _MARK in value:
                raise ChatTemplateError("message text holds U+FDD0 or U+FDD1 (noncharacters); remove them")
            if self._pattern is None:
                return value
            return self._pattern.sub(lambda m: f"{_ESC}{self._index[m.group()]}{_ESC}", value)
        if isinstance(value, dict):
            return {k: self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def encode(self, rendered: str) -> list[int]:
        """Ids of text rendered from escaped messages."""
        if self._pattern is not None:
            rendered = self._pattern.sub(lambda m: self._marker_of[m.group()], rendered)
        rendered = _ESCAPED.sub(lambda m: self.specials[int(m.group(1))], rendered)
        ids = self._text.encode(rendered, add_special_tokens=False).ids
        return [self._special_of.get(i, i) for i in ids]

    def text(self, rendered: str) -> str:
        """What the model reads, as text: placeholders back to the words the client sent."""
        return _ESCAPED.sub(lambda m: self.specials[int(m.group(1))], rendered)
