"""Reading a request body, the same for ``lmplug serve`` and the prefill/decode router: a JSON
content type (a browser sends ``text/plain`` cross-origin without a preflight), a byte limit
checked on the declared length and on what arrives, and JSON that is an object with text JSON
can carry (a lone surrogate is a 400 naming its field)."""

from __future__ import annotations

import json

from starlette.requests import Request

from lmplug.serve.errors import APIError
from lmplug.serve.unicode import check_unicode


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body of a JSON request: 415 for another content type, 413 past ``limit`` bytes."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type: expected application/json (got {media_type or 'none'!r})",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_object(raw: bytes) -> dict:
    """The body as a JSON object (400 for bad JSON, another type, or text it cannot encode)."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # e.g. 100,000 nested arrays: no request field is nested that deep
        raise APIError(400, "request body: JSON nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body: expected a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    check_unicode(data)  # before any field is used: a lone surrogate is a 400 naming its field
    return data


async def read_json(request: Request, limit: int) -> dict:
    """``read_body`` then ``parse_object``."""
    return parse_object(await read_body(request, limit))


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body: {size} bytes or more, over the limit of {limit} bytes",
                    code="request_too_large")
