"""The prefill/decode router: one OpenAI endpoint in front of a prefill and a decode instance.

Each completion request goes first to the prefill instance as a copy with ``max_tokens: 1``,
``stream: false`` (and nothing that only shapes the answer: ``n``, logprobs, ``echo``,
``min_tokens``), which computes the prompt and, through its ``torch_distributed`` KV connector,
pushes the prompt's full blocks to the decode instance before it answers. Then the original
request goes to the decode instance, whose prefix cache finds those blocks, and its answer
(streamed or not) is relayed back byte for byte. The client sees one endpoint.

Failures: a prefill that fails or takes longer than ``prefill_timeout_s`` is logged with the
request id and the request goes to decode anyway (which computes the prompt itself); a decode
instance that cannot be reached is a 502 (``decode_unavailable``) with an OpenAI error body, and
a stream it breaks off ends with an OpenAI error event. The router keeps no model and checks no
API key itself: ``Authorization`` goes through to the instances, which check it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmplug.serve.errors import APIError, install_handlers

logger = logging.getLogger(__name__)

# request fields the prefill copy drops: they shape the answer, not the prompt's K/V
_ANSWER_ONLY = ("max_completion_tokens", "stream_options", "min_tokens", "n", "best_of", "logprobs",
                "top_logprobs", "prompt_logprobs", "echo")
_FORWARDED = ("authorization", "content-type", "x-request-id")  # request headers the instances see
_RELAYED = ("content-type", "content-encoding", "cache-control", "x-accel-buffering")  # and back


@dataclass
class RouterSettings:
    decode_url: str  # e.g. http://127.0.0.1:8001
    prefill_url: str | None = None  # None: every request goes to decode alone
    prefill_timeout_s: float = 60.0  # the whole prefill call; past it decode computes the prompt
    decode_timeout_s: float = 600.0  # connect, and between two chunks of decode's answer
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        self.decode_url = self.decode_url.rstrip("/")
        self.prefill_url = self.prefill_url.rstrip("/") if self.prefill_url else None
        if not (self.prefill_timeout_s > 0 and self.decode_timeout_s > 0):
            raise ValueError("prefill_timeout_s and decode_timeout_s: expected positive numbers of seconds")


def prefill_body(body: dict) -> dict:
    """The prefill copy of a request: the same prompt, one token, no stream."""
    return {**{k: v for k, v in body.items() if k not in _ANSWER_ONLY}, "max_tokens": 1, "stream": False}


def create_router(settings: RouterSettings) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(settings.decode_timeout_s, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="lmplug router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    install_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _route(client, settings, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _route(client, settings, request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _decode(client, settings, "GET", "/v1/models", None, _headers(request), "models")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        status = {"decode": await _health(client, settings.decode_url, request)}
        if settings.prefill_url is not None:
            status["prefill"] = await _health(client, settings.prefill_url, request)
        ok = status["decode"] == "ok"
        return JSONResponse({"status": "ok" if ok else "decode_unavailable", **status},
                            status_code=200 if ok else 503)

    return app


async def _route(client: httpx.AsyncClient, settings: RouterSettings, request: Request, path: str) -> Response:
    raw = await _read_body(request, settings.max_body_bytes)
    headers = _headers(request)
    request_id = headers.setdefault("x-request-id", f"pd-{uuid.uuid4().hex[:16]}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = None  # decode answers the 400
    if settings.prefill_url is not None and isinstance(body, dict):
        await _prefill(client, settings, path, body, headers, request_id)
    return await _decode(client, settings, "POST", path, raw, headers, request_id)


async def _prefill(client: httpx.AsyncClient, settings: RouterSettings, path: str, body: dict,
                   headers: dict[str, str], request_id: str) -> None:
    url = settings.prefill_url + path
    try:
        response = await client.post(url, json=prefill_body(body), headers=headers,
                                     timeout=settings.prefill_timeout_s)
    except httpx.HTTPError as exc:
        logger.warning("request %s: prefill at %s failed (%s: %s); decode computes the prompt",
                       request_id, url, type(exc).__name__, exc)
        return
    if response.status_code != 200:
        logger.warning("request %s: prefill at %s answered %d (%s); decode computes the prompt",
                       request_id, url, response.status_code, response.text[:300])


async def _decode(client: httpx.AsyncClient, settings: RouterSettings, method: str, path: str,
                  raw: bytes | None, headers: dict[str, str], request_id: str) -> Response:
    url = settings.decode_url + path
    try:
        upstream = await client.send(client.build_request(method, url, content=raw, headers=headers),
                                     stream=True)
    except httpx.HTTPError as exc:
        logger.warning("request %s: decode at %s failed (%s: %s)", request_id, url, type(exc).__name__, exc)
        return APIError(502, f"the decode instance did not answer ({type(exc).__name__}: {exc}); "
                             "retry later", code="decode_unavailable", type="server_error").response()
    relayed = {k: v for k, v in upstream.headers.items() if k.lower() in _RELAYED}
    return StreamingResponse(_relay(upstream, request_id), status_code=upstream.status_code, headers=relayed)


async def _relay(upstream: httpx.Response, request_id: str) -> AsyncIterator[bytes]:
    """Decode's answer as it comes; a break mid-answer ends an event stream with an error event."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("request %s: decode broke off its answer (%s: %s)", request_id, type(exc).__name__, exc)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            error = APIError(502, f"the decode instance broke off the stream ({type(exc).__name__})",
                             code="decode_unavailable", type="server_error")
            yield f"data: {error.body().model_dump_json()}\n\n".encode()
    finally:
        await upstream.aclose()


async def _health(client: httpx.AsyncClient, base: str, request: Request) -> str:
    try:
        response = await client.get(base + "/health", headers=_headers(request), timeout=5.0)
    except httpx.HTTPError as exc:
        return f"unreachable ({type(exc).__name__})"
    return "ok" if response.status_code == 200 else f"status {response.status_code}"


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body: {size} bytes or more, over the limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
