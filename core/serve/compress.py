"""Prompt compression for the server: the request's ``compression`` extra field -> a shorter prompt.

``compression`` is a method name, a dict of ``CompressionParams`` fields (``method``, ``rate``,
``protect``, ``options``), ``true`` (the config's default) or ``false`` (off); absent: the config's
``compression`` section, if any. Compression runs on a worker thread (its scorer is a separate
engine), so other requests' steps go on meanwhile. A bad field is a 400 naming it; a compressor that
fails falls back to the full prompt (``lmplug.compression``), never losing the request. Usage then
reports ``prompt_tokens_before_compression`` beside ``prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from starlette.concurrency import run_in_threadpool

from lmplug.compression import CANCEL, PromptCompressor
from lmplug.errors import ConfigError
from lmplug.interfaces.compressor import CompressionParams, CompressionReport
from lmplug.serve.errors import APIError


def wanted(compressor: PromptCompressor, field: Any) -> bool:
    if field is None:
        return compressor.enabled_by_default
    return field is not False


def _params(field: Any) -> CompressionParams | None:
    if field is True or field is None:
        return None
    if isinstance(field, str):
        field = {"method": field}
    if not isinstance(field, dict):
        raise APIError(400, "compression: expected a method name, an object (method, rate, protect, options) "
                       f"or a boolean, got {type(field).__name__}", param="compression")
    try:
        return CompressionParams.coerce(field)
    except (ConfigError, TypeError, ValueError) as exc:
        raise _bad(exc) from None


async def compress_texts(compressor: PromptCompressor, field: Any, prompts: list
                         ) -> tuple[list, list[CompressionReport | None]]:
    """Text prompts compressed (token-id prompts cannot be, and are refused when compression is
    asked for explicitly); one report per prompt."""
    reports: list[CompressionReport | None] = [None] * len(prompts)
    if not wanted(compressor, field):
        return prompts, reports
    params = _params(field)
    out = list(prompts)
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            if field is None:
                continue
            raise APIError(400, "compression: needs a text prompt (got token ids)", param="compression")
        out[i], reports[i] = await _run(compressor.compress_text, prompt, params)
    return out, reports


async def compress_chat(compressor: PromptCompressor, field: Any, messages: list[dict],
                        **template_kwargs: Any) -> tuple[list[dict], CompressionReport | None]:
    if not wanted(compressor, field):
        return messages, None
    return await _run(compressor.compress_messages, messages, _params(field), **template_kwargs)


async def _run(fn, *args: Any, **kwargs: Any):
    """``fn`` on a worker thread; cancelling the awaiting task (the app does when the client
    disconnects) tells the thread to stop at its next engine step (``lmplug.compression.CANCEL``)."""
    cancel = threading.Event()
    token = CANCEL.set(cancel)  # the thread runs in a copy of this context, so it sees this event
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except ConfigError as exc:
        raise _bad(exc) from None
    except asyncio.CancelledError:
        cancel.set()
        raise
    finally:
        CANCEL.reset(token)


def _bad(exc: Exception) -> APIError:
    """A 400 whose ``param`` is the field the message names (``compression.rate``, ...)."""
    message = str(exc)
    if not message.startswith("compression"):
        message = f"compression: {message}"
    return APIError(400, message, param=message.split(":", 1)[0])


def tokens_before(reports: list[CompressionReport | None]) -> int | None:
    """Prompt tokens before compression, summed over prompts (None: nothing was compressed)."""
    if all(r is None for r in reports):
        return None
    return sum(r.prompt_tokens_before for r in reports if r is not None)
