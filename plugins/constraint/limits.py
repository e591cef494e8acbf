"""Bounding the time one compile may take, and trimming the engines' messages into errors.

A JSON schema or grammar comes from a client, and some compile for a very long time (deep
nesting, huge repetition counts). The compile runs in a daemon worker thread; when it has not
finished after ``max_compile_s`` the request is refused. The native compile cannot be stopped,
so the thread finishes on its own and its result is dropped.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TypeVar

from lmplug.api import ConstraintError

T = TypeVar("T")
MAX_MESSAGE_CHARS = 600


def compile_within(seconds: float, field: str, backend: str, build: Callable[[], T]) -> T:
    """``build()``, or ``ConstraintError(field, ...)`` if it raises or runs past ``seconds``."""
    result: list = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            failure.append(exc)

    worker = threading.Thread(target=work, name=f"lmplug-{backend}-compile", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise ConstraintError(field, f"structured output {field}: compiling it with {backend} took longer "
                              f"than max_compile_s = {seconds:g} s; refused (simplify it, or raise "
                              f"constraint.max_compile_s)")
    if failure:
        exc = failure[0]
        if isinstance(exc, ConstraintError):
            raise exc
        raise ConstraintError(field, f"structured output {field}: {backend} cannot compile it: "
                              f"{trim(str(exc))}") from None
    return result[0]


def trim(message: str) -> str:
    """An engine's message without its source-file prefix and timestamp, on one bounded line."""
    message = re.sub(r"\[\d\d:\d\d:\d\d\]\s*\S+:\d+:\s*", "", message)
    message = " ".join(message.split())
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."
