"""Text a request cannot carry: JSON allows ``"\\ud800"`` (a lone surrogate), UTF-8 cannot encode it.

Every string of a request body (values and keys, at any depth) is checked once, right after the
body is parsed, so no field (a prompt to compress, a stop string, a tool's description) reaches
code that would fail on it with a 500. The walk is iterative: a body may nest as deep as the JSON
parser allows.
"""

from __future__ import annotations

from typing import Any

from lmplug.serve.errors import APIError


def lone_surrogate(data: Any) -> tuple[str, str, int] | None:
    """(the field's path, e.g. ``messages[0].content``; the string; the index of its lone
    surrogate) of the first string that is not valid Unicode, or None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            at = _bad_at(value)
            if at is not None:
                return where or "request body", value, at
        elif isinstance(value, dict):
            for key, item in value.items():
                at = _bad_at(key)
                if at is not None:
                    return f"{where or 'request body'} (a key)", key, at
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None


def check_unicode(data: Any) -> None:
    """A 400 naming the field when any string in ``data`` has a lone surrogate."""
    found = lone_surrogate(data)
    if found is None:
        return
    where, text, at = found
    param = where.split(".", 1)[0].split("[", 1)[0].split(" ", 1)[0]
    raise APIError(400, f"{where}: not valid Unicode (a lone surrogate {text[at]!r} at character {at}); "
                        "send UTF-8 text", param=param)


def _bad_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None
