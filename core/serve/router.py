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
a stream it breaks off ends with an OpenAI error event. The router keeps no model.

It is as careful as the instances behind it, with the same code (``lmplug.serve.hardening``,
``lmplug.serve.body``): Host names (DNS rebinding) and CORS origins, the request-head and body
deadlines (408), the body limit (413), JSON checked before anything is forwarded, and the API key
checked here when one is set (``Authorization`` still goes through to the instances, which check
it too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmplug.serve.body import parse_object, read_body
from lmplug.serve.errors import APIError, install_handlers
from lmplug.serve.hardening import api_key_check, guard_app

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
    api_key: str | None = None  # None: $LMPLUG_API_KEY if set, else no key needed
    bind_host: str = "127.0.0.1"  # which Host headers are accepted (as ``ServeSettings``)
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    read_timeout_s: float = 30.0  # a request head, and then its body, must arrive within this
    public_health: bool = False  # /health without the API key

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("LMPLUG_API_KEY") or None
        if self.max_body_bytes < 1 or not self.read_timeout_s > 0:
            raise ValueError("max_body_bytes and read_timeout_s: expected positive numbers")
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
    guard_app(app, bind_host=settings.bind_host, extra_hosts=settings.allowed_hosts,
              cors_origins=settings.cors_origins, read_timeout=settings.read_timeout_s)
    install_handlers(app)
    keyed = [Depends(api_key_check(settings.api_key))]

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(request: Request) -> Response:
        return await _route(client, settings, request, "/v1/chat/completions")

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request) -> Response:
        return await _route(client, settings, request, "/v1/completions")

    @app.get("/v1/models", dependencies=keyed)
    async def models(request: Request) -> Response:
        return await _decode(client, settings, "GET", "/v1/models", None, _headers(request), "models")

    @app.get("/health", dependencies=[] if settings.public_health else keyed)
    async def health(request: Request) -> JSONResponse:
        status = {"decode": await _health(client, settings.decode_url, request)}
        if settings.prefill_url is not None:
            status["prefill"] = await _health(client, settings.prefill_url, request)
        ok = status["decode"] == "ok"
        return JSONResponse({"status": "ok" if ok else "decode_unavailable", **status},
                            status_code=200 if ok else 503)

    return app


async def _route(client: httpx.AsyncClient, settings: RouterSettings, request: Request, path: str) -> Response:
    raw = await read_body(request, settings.max_body_bytes)
    body = parse_object(raw)
    headers = _headers(request)
    request_id = headers.setdefault("x-request-id", f"pd-{uuid.uuid4().hex[:16]}")
    if settings.prefill_url is not None:
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

