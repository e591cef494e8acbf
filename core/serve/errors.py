"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Bad input is always a 4xx naming the field and what was expected; only a fault
of the server itself is a 500, and its body never carries a traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from lmplug.errors import LmplugError
from lmplug.serve.protocol import ErrorInfo, ErrorResponse
from lmplug.serve.security import BodyTimeout

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 500: "server_error",
          503: "service_unavailable"}
# what a union-typed field accepts, said once instead of one pydantic line per branch
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "tool_choice": "a string or an object",
    "guided_json": "a JSON schema (an object) or its JSON text",
    "json": "a JSON schema (an object) or its JSON text",
    "schema": "a JSON schema (an object)",
}
_UNION_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}


class APIError(Exception):
    """An error with its HTTP status, sent as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as ``field: what was expected (got value)``."""
    err = exc.errors()[0]
    path = _field_path(err["loc"])
    leaf = path.rsplit(".", 1)[-1].split("[", 1)[0]
    if err["type"] == "extra_forbidden":
        message = f"{path}: unrecognized request argument"
    elif err["type"] == "missing":
        message = f"{path}: required field is missing"
    elif _is_union_error(err["loc"]) and leaf in _EXPECTED:
        message = f"{path}: expected {_EXPECTED[leaf]}"
    else:
        message = f"{path}: {err['msg']}"
    if err["type"] != "missing":
        message += f" (got {_short_repr(err.get('input'))})"
    return APIError(400, message, param=path or None, code="invalid_value")


def _field_path(loc: tuple) -> str:
    """``('messages', 0, 'content', 'str')`` -> ``messages[0].content`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_union_tag(part):
            break
        else:
            out += f".{part}" if out else part
    return out


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


def _is_union_error(loc: tuple) -> bool:
    return any(_is_union_tag(p) for p in loc)


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def install_handlers(app: FastAPI) -> None:
    """Every exception becomes an OpenAI error body; lmplug's own errors are the caller's (400)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, exc: BodyTimeout) -> JSONResponse:
        logger.info("%s %s: %s; closing the connection", request.method, request.url.path, exc)
        response = APIError(408, str(exc), code="request_timeout").response()
        response.headers["Connection"] = "close"
        return response

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # one line, no traceback: a client may always leave; counted apart from errors (499)
        logger.info("%s %s: the client disconnected before sending its whole body",
                    request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(LmplugError)
    async def _lmplug_error(request: Request, exc: LmplugError) -> JSONResponse:
        return APIError(400, str(exc)).response()

    @app.exception_handler(ValidationError)
    async def _validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()[:1]}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, type=_TYPES.get(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__})").response()
