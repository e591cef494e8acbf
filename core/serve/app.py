"""The FastAPI app: OpenAI routes, API key, body limits, ``/health`` and ``/metrics``.

``create_app(llm, ServeSettings(...))`` builds an app around an ``LLM`` (its engine
moves to the ``AsyncEngine`` thread when the app starts; do not use the ``LLM``
from other threads while the app runs). ``lmplug.serve.server`` runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from lmplug.compression import PromptCompressor
from lmplug.interfaces.adapter import LoRARequest
from lmplug.interfaces.params import SamplingParams
from lmplug.llm import LLM
from lmplug.serve import compress, convert, embeddings, responses_api, tokenize_routes
from lmplug.serve import tools as tool_calls
from lmplug.serve.async_engine import AsyncEngine
from lmplug.serve.body import read_json
from lmplug.serve.errors import APIError, from_validation_error, install_handlers
from lmplug.serve.hardening import api_key_check, guard_app
from lmplug.serve.lora_routes import Models, lora_router
from lmplug.serve.metrics import Metrics
from lmplug.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from lmplug.serve.responses import Accumulator, ChatFormat, CompletionFormat, collect, stream_events

logger = logging.getLogger(__name__)

API_KEY_ENV = "LMPLUG_API_KEY"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint; chat: the rest of the context


@dataclass
class ServeSettings:
    api_key: str | None = None  # None: $LMPLUG_API_KEY if set, else no key needed
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None  # default: the config's `model`
    shutdown_grace_s: float = 30.0  # in-flight requests may finish for this long, then are cut
    bind_host: str = "127.0.0.1"  # set by build_server: which Host headers are accepted
    allowed_hosts: tuple[str, ...] = ()  # more Host names to accept ("*": any)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (none by default)
    read_timeout_s: float = 30.0  # a request head, and then its body, must arrive within this
    public_health: bool = False  # /health without the API key
    public_metrics: bool = False  # /metrics without the API key
    allow_special_in_content: bool = False  # special-token text in chat messages stays text
    max_num_seqs: int = 1024  # sequences (n x prompts) of all open requests together; past it: 429
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, folder) loaded at start
    tool_parser: str = "auto"  # reads tool calls out of chat output: auto (by the chat template), hermes,
    #                            llama3, mistral, none (lmplug.serve.tools.parser_for)

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: expected a positive number of bytes")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s={self.read_timeout_s}: expected a positive number of seconds")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: expected a positive number of sequences")


def create_app(llm: LLM, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    metrics = Metrics()
    engine = AsyncEngine(llm.engine, metrics, max_num_seqs=settings.max_num_seqs)
    model_name = settings.served_model_name or llm.engine.config.model
    template = llm.engine.tokenizer.chat_template if llm.engine.tokenizer is not None else None
    parser = tool_calls.parser_for(settings.tool_parser, template)  # an unknown name fails here, at start
    for k, (name, path) in enumerate(settings.lora_modules, start=1):  # a bad adapter fails here, at start
        llm.engine.add_lora(LoRARequest(name, k, path))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="lmplug", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    if llm.engine.tokenizer is not None:
        llm.engine.tokenizer.allow_special_in_content = settings.allow_special_in_content
    guard_app(app, bind_host=settings.bind_host, extra_hosts=settings.allowed_hosts,
              cors_origins=settings.cors_origins, read_timeout=settings.read_timeout_s)
    app.add_middleware(_CountRequests, metrics=metrics)
    install_handlers(app)
    _add_plain_routes(app, engine, metrics, settings)
    app.include_router(_v1_router(engine, settings, model_name, parser, llm.compressor))
    _add_tokenizer_routes(app, engine.engine, settings, model_name)
    _add_embeddings_route(app, engine, settings, model_name)
    return app


def _add_embeddings_route(app: FastAPI, engine: AsyncEngine, settings: ServeSettings, model_name: str) -> None:
    """/v1/embeddings (``embeddings``): pooled final hidden states in OpenAI's shape."""
    async def read(request: Request, model: type[BaseModel]) -> Any:
        return _parse(model, await read_json(request, settings.max_body_bytes))

    app.include_router(embeddings.embeddings_router(
        engine, read, functools.partial(_check_model, model_name), model_name,
        [Depends(api_key_check(settings.api_key))]))


def _add_tokenizer_routes(app: FastAPI, core: Any, settings: ServeSettings, model_name: str) -> None:
    """/tokenize, /detokenize (and under /v1), /version: vLLM's shapes (``tokenize_routes``)."""
    keyed = [Depends(api_key_check(settings.api_key))]

    async def read(request: Request, model: type[BaseModel]) -> Any:
        return _parse(model, await read_json(request, settings.max_body_bytes))

    check_model = functools.partial(_check_model, model_name)

    for prefix in ("", "/v1"):
        app.include_router(tokenize_routes.tokenizer_router(core, read, check_model, prefix, keyed))
    app.include_router(tokenize_routes.version_router([] if settings.public_health else keyed))


def _check_model(model_name: str, requested: str | None) -> None:
    """A request naming another model than the one served: 404 in OpenAI's shape."""
    if requested is not None and requested != model_name:
        raise APIError(404, f"model: {requested!r} is not served here (available: {model_name!r})",
                       param="model", code="model_not_found")


def _add_plain_routes(app: FastAPI, engine: AsyncEngine, metrics: Metrics, settings: ServeSettings) -> None:
    def guarded(public: bool) -> list:
        return [] if public else [Depends(api_key_check(settings.api_key))]

    @app.get("/health", dependencies=guarded(settings.public_health))
    async def health() -> JSONResponse:
        if engine.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if not engine.is_running:
            return JSONResponse({"status": "engine_stopped"}, status_code=503)
        failure = getattr(engine.engine.parallel, "failure", None)  # a tensor/pipeline-parallel rank died
        if failure is not None:
            return JSONResponse({"status": "parallel_worker_failed", "detail": failure}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=guarded(settings.public_metrics))
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)


def _v1_router(engine: AsyncEngine, settings: ServeSettings, model_name: str,
               parser: tool_calls.ToolParser | None, compressor: PromptCompressor) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(settings.api_key))])
    core = engine.engine
    names = convert.TokenText(core.tokenizer)

    served = Models(engine, model_name)  # the base model and the LoRA adapters loaded

    async def read(request: Request, model: type[BaseModel]) -> Any:
        return _parse(model, await read_json(request, settings.max_body_bytes))

    router.include_router(lora_router(engine, read))

    @router.get("/models")
    async def models() -> ModelList:
        now = int(time.time())
        return ModelList(data=[ModelCard(id=model_name, created=now, max_model_len=core.max_model_len)] + [
            ModelCard(id=lora.lora_name, created=now, max_model_len=core.max_model_len, root=lora.lora_path,
                      parent=model_name) for lora in core.list_loras()])

    @router.post("/chat/completions")
    async def chat(request: Request) -> Response:
        return await run_chat(request, _parse(ChatCompletionRequest, await read_json(request, settings.max_body_bytes)))

    store = responses_api.ResponseStore()

    @router.post("/responses")
    async def responses(request: Request) -> Response:
        plan = responses_api.plan(await read_json(request, settings.max_body_bytes), store)
        answer = await run_chat(request, _parse(ChatCompletionRequest, plan.chat))
        if isinstance(answer, _SSEResponse):
            events = responses_api.stream(answer.body_iterator, plan, store, model_name)
            return _SSEResponse(events, on_close=answer._on_close)
        if answer.status_code != 200:
            return answer
        body = responses_api.finish(json.loads(answer.body), plan, store, model_name)
        return JSONResponse(body)

    async def run_chat(request: Request, req: ChatCompletionRequest) -> Response:
        lora = served.resolve(req.model)
        tools = convert.tool_plan(req, parser)
        constraint = convert.structured_output(req, tools)
        tool_list = None if tools is None else tools.tools
        messages, report = None, None
        if compress.wanted(compressor, req.compression):
            # a client that leaves stops its compression (the worker thread checks between steps)
            done = await _unless_disconnected(request, compress.compress_chat(
                compressor, req.compression, convert.template_messages(req),
                **({} if tool_list is None else {"tools": tool_list})))
            if done is None:
                return Response(status_code=499)
            messages, report = done
        prompts = [await run_in_threadpool(convert.chat_prompt_ids, core.tokenizer, req, tool_list, messages)]
        params = convert.sampling_params(req, prompts, core.max_model_len, None, constraint, tools)
        fmt = ChatFormat(req.model if lora else model_name, params.logprobs, names, tools)
        return await _respond(request, engine, req, prompts, params, fmt, constraint,
                              compress.tokens_before([report]), lora)

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await read_json(request, settings.max_body_bytes))
        lora = served.resolve(req.model)
        constraint = convert.structured_output(req)
        texts = convert.prompt_list(req)
        reports: list = [None] * len(texts)
        if compress.wanted(compressor, req.compression):
            done = await _unless_disconnected(request, compress.compress_texts(compressor, req.compression, texts))
            if done is None:  # the client left while its prompt was compressed
                return Response(status_code=499)
            texts, reports = done
        prompts = await run_in_threadpool(convert.completion_prompt_ids, core.tokenizer, req,
                                          core.model_config.vocab_size, texts)
        params = convert.sampling_params(req, prompts, core.max_model_len, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                         constraint)
        echo = convert.echo_texts(core.tokenizer, req, prompts) if req.echo else None
        fmt = CompletionFormat(req.model if lora else model_name, params.logprobs, names, echo, prompts)
        return await _respond(request, engine, req, prompts, params, fmt, constraint,
                              compress.tokens_before(reports), lora)

    return router


async def _respond(request: Request, engine: AsyncEngine, req: ChatCompletionRequest | CompletionRequest,
                   prompts: list[list[int]], params: SamplingParams, fmt: ChatFormat | CompletionFormat,
                   constraint: convert.Constraint | None, tokens_before_compression: int | None = None,
                   lora: LoRARequest | None = None) -> Response:
    beam_field = "best_of" if getattr(req, "best_of", None) else "n"  # what sets the beam width
    group = engine.generate(prompts, params, fmt.id, on_refused=partial(convert.admission_error,
                                                                         constraint=constraint,
                                                                         beam_field=beam_field),
                            lora=lora)
    try:
        # what the engine refuses on admission (a schema that does not compile, ...) is a 400,
        # streamed or not: no headers go out before the engine has taken the request
        await group.admitted()
    except BaseException:
        group.close()
        raise
    acc = Accumulator(len(prompts), params.n)
    acc.prompt_tokens_before_compression = tokens_before_compression
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSEResponse(stream_events(group, fmt, acc, include_usage), on_close=group.close)
    try:
        body = await _unless_disconnected(request, collect(group, fmt, acc))
    finally:
        group.close()  # aborts what is left if the client went away or the handler was cancelled
    if body is None:  # the client left; its requests are already aborted
        return Response(status_code=499)
    return Response(body.model_dump_json(), media_type="application/json")


# -- request plumbing ----------------------------------------------------------------------------


def _parse(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any | None:
    """Await ``work``, or cancel it (which aborts its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """A stream that stops (and so aborts its requests) as soon as the client disconnects,
    whatever ASGI spec version the server speaks, and always closes its generator."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            self._on_close()  # a stream that never started still holds its requests


class _CountRequests:
    """ASGI middleware: count HTTP requests by route and status code (streams included)."""

    _ROUTES: ClassVar[frozenset[str]] = frozenset(
        {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            route = scope["path"] if scope["path"] in self._ROUTES else "other"
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            if status == 499:  # the client went away (mid-body or before its answer): not a 500
                self.metrics.client_disconnects.labels(route=route).inc()
