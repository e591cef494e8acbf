"""``AsyncEngine``: one thread owns the ``LLMEngine``; HTTP handlers talk to it through queues.

The engine is not thread-safe and a step is seconds of blocking compute on a
CPU, so it lives on its own thread, never on the event loop. Handlers post
commands (add, abort, cut) to that thread; it applies them between steps and
steps while any request is unfinished, so requests from concurrent HTTP
connections share every batch (continuous batching across clients). Outputs
go back to the event loop as per-choice deltas, one ``asyncio.Queue`` per
``RequestGroup`` (a completions call with several prompts is one group of
engine requests).

A request the engine refuses when it admits it (``add_request`` raising, e.g. a
JSON schema that does not compile) is a 400: ``RequestGroup.admitted()`` resolves
once the engine thread has taken every request of the group, so a handler can
answer with a status before it starts a stream; ``on_refused`` turns the
engine's error into the response (naming the request field).

One request's failure stays its own: the engine ends it with
``finish_reason="error"`` and it gets a 500 (``engine_error``) while the others
go on. Only an exception that escapes a step (e.g. the forward pass itself)
fails every request in flight with a 500; the thread carries on. A client that
goes away aborts its requests, which frees their KV cache at once.

``max_num_seqs``: sequences (n x prompts) all open requests may hold together;
a request past it gets a 429 (``too_many_sequences``) and may retry later.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Self

from lmplug.engine.engine import LLMEngine
from lmplug.errors import LmplugError
from lmplug.interfaces.adapter import LoRARequest
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Logprob
from lmplug.outputs import EmbeddingRequestOutput, PoolingParams, RequestMetrics, RequestOutput
from lmplug.serve.errors import APIError
from lmplug.serve.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass
class ChoiceDelta:
    """What one sample added since the previous update."""

    index: int  # the sample's index within its engine request (0 .. n-1)
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # set on the sample's last delta


@dataclass
class Update:
    request_id: str
    prompt_index: int  # which prompt of the group
    num_prompt_tokens: int
    choices: list[ChoiceDelta]
    finished: bool  # the whole engine request is done
    error: APIError | None = None
    # with SamplingParams.prompt_logprobs: the prompt's logprobs (entry 0 None), on the first
    # update that has generated tokens (the prompt is complete then)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # on the finishing update: the request's metrics (the usage reports its speculative decoding)
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None  # an embedding request's vector (``AsyncEngine.embed``)


@dataclass
class _Tracked:
    """The engine thread's record of one request: what has been sent, and when."""

    group: RequestGroup
    prompt_index: int
    num_prompt_tokens: int
    n: int
    submitted_at: float
    first_token_at: float | None = None
    sent_prompt_logprobs: bool = False
    sent_text: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sent_text, self.sent_tokens, self.done = [0] * self.n, [0] * self.n, [False] * self.n


class RequestGroup:
    """Engine requests whose updates share one queue. Use as ``async with``: leaving the block
    early (client gone, error, cancellation) aborts whatever is still running."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], num_seqs: int = 0,
                 on_refused: Callable[[LmplugError], APIError] | None = None) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self.num_seqs = num_seqs  # sequences it holds (n x prompts), for the server-wide limit
        self.on_refused = on_refused  # called on the engine thread: must not touch the event loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._to_admit = len(request_ids)
        self._admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def admitted(self) -> None:
        """Wait until the engine has taken every request of the group; raise the ``APIError`` of
        the first it refused (the others are aborted when the group closes)."""
        await self._admitted

    def _admission(self, error: APIError | None) -> None:
        """Event loop side: one request was taken (``error`` None) or refused."""
        if self._admitted.done():
            return
        self._to_admit -= 1
        if error is not None:
            self._admitted.set_exception(error)
        elif self._to_admit == 0:
            self._admitted.set_result(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()
        self._engine._groups.discard(self)

    async def __aiter__(self) -> AsyncIterator[Update]:
        while self._unfinished:
            update = await self.queue.get()
            if update.error is not None:
                self._unfinished.discard(update.request_id)
                raise update.error
            if update.finished:
                self._unfinished.discard(update.request_id)
            yield update


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None, *, idle_wait_s: float = 0.5,
                 max_num_seqs: int | None = None) -> None:
        self.engine = engine
        self.max_num_seqs = max_num_seqs  # None: no server-wide limit
        self.metrics = metrics or Metrics()
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._compiling: dict[str, tuple] = {}  # engine thread only: "add" commands waiting for a compile
        self._groups: set[RequestGroup] = set()  # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.draining = False

    # -- lifecycle (event loop side) ------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="lmplug-engine", daemon=True)
        self._thread.start()
        self.engine.constraints.prepare_in_background()  # the first constrained request skips the set-up

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_active_groups(self) -> int:
        return len(self._groups)

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, let those in flight finish for ``grace_s``, then cut the rest:
        each gets a last update with ``finish_reason="abort"``."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._groups and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self._groups:
            return
        logger.warning("grace period over: cutting %d request group(s)", len(self._groups))
        self._post(("cut",))
        deadline = loop.time() + 5.0  # time for the handlers to send their last chunk
        while self._groups and loop.time() < deadline:
            await asyncio.sleep(0.05)

    # -- requests (event loop side) ---------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                 on_refused: Callable[[LmplugError], APIError] | None = None, *,
                 pooling: PoolingParams | None = None, lora: LoRARequest | None = None) -> RequestGroup:
        """Queue one engine request per prompt (ids ``{request_id}-{i}``); outputs arrive on the group.
        ``on_refused``: the response for a request ``add_request`` refuses (default: a 400 with its
        message)."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance")
        if not self.is_running:
            raise APIError(503, "the engine is not running")
        num_seqs = params.n * len(prompts)
        held = sum(g.num_seqs for g in self._groups)
        if self.max_num_seqs is not None and num_seqs > self.max_num_seqs:
            raise APIError(400, f"n: {num_seqs} sequences (n x prompts), more than this server's limit of "
                                f"{self.max_num_seqs} for all requests together", param="n")
        if self.max_num_seqs is not None and held + num_seqs > self.max_num_seqs:
            raise APIError(429, f"the server holds {held} sequences in flight; this request's {num_seqs} "
                                f"(n x prompts) would pass its limit of {self.max_num_seqs}; retry later",
                           code="too_many_sequences", type="rate_limit_error")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        group = RequestGroup(self, ids, num_seqs, on_refused)
        self._groups.add(group)
        now = time.perf_counter()
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            self._post(("add", rid, i, prompt, params, group, now, pooling, lora))
        return group

    async def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the engine thread between steps (the engine is not thread-safe: loading
        and unloading LoRA adapters); its result, or its exception raised here."""
        if not self.is_running:
            raise APIError(503, "the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(("call", fn, loop, future))
        return await future

    def embed(self, prompts: list[list[int]], pooling: PoolingParams, request_id: str) -> RequestGroup:
        """Queue one embedding request per prompt; each one's single update carries its vector."""
        return self.generate(prompts, SamplingParams(max_tokens=1), request_id, pooling=pooling)

    def abort(self, request_ids: list[str]) -> None:
        self._post(("abort", request_ids))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception as exc:
                logger.exception("engine loop failed; failing %d request(s)", len(self._tracked))
                self._fail_all(exc)
        self._cut_all()
        self._refuse_pending()

    def _refuse_pending(self) -> None:
        """The thread is ending: requests still queued are never added; tell their handlers."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "call":
                _, _, loop, future = command
                loop.call_soon_threadsafe(_settle, future, None,
                                          APIError(503, "the server is shutting down; retry on another instance"))
            if command[0] == "add":
                rid, index, prompt, _, group, _, _, _ = command[1:]
                error = APIError(503, "the server is shutting down; retry on another instance")
                self._deliver([(group, Update(rid, index, len(prompt), [], True, error))], admission=error)

    def _iterate(self) -> None:
        self._apply_commands()
        if not self._tracked:
            self._wake.wait(self.idle_wait_s)
            self._wake.clear()
        elif not self.engine.has_unfinished_requests():
            self._fail_all(RuntimeError("the engine dropped the request"))
        else:
            self._step()

    def _apply_commands(self) -> None:
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            kind, args = command[0], command[1:]
            if kind == "add":
                self._add(*args)
            elif kind == "compiled":
                self._compiled(*args)
            elif kind == "abort":
                for rid in args[0]:
                    self._abort(rid)
            elif kind == "cut":
                self._cut_all()
            elif kind == "call":
                self._call(*args)
            changed = True
        if changed:
            self._publish_stats()

    def _call(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        try:
            result, error = fn(), None
        except Exception as exc:  # noqa: BLE001  (handed to the caller, which answers for it)
            result, error = None, exc
        loop.call_soon_threadsafe(_settle, future, result, error)

    def _add(self, rid: str, index: int, prompt: list[int], params: SamplingParams, group: RequestGroup,
             submitted_at: float, pooling: PoolingParams | None = None, lora: LoRARequest | None = None) -> None:
        try:
            if self._compile_first(rid, (rid, index, prompt, params, group, submitted_at, pooling, lora)):
                return
        except LmplugError as exc:
            self._refuse(rid, index, prompt, group, exc)
            return
        self._admit(rid, index, prompt, params, group, submitted_at, pooling, lora)

    def _admit(self, rid: str, index: int, prompt: list[int], params: SamplingParams, group: RequestGroup,
               submitted_at: float, pooling: PoolingParams | None = None, lora: LoRARequest | None = None) -> None:
        try:
            self.engine.add_request(rid, prompt, params, pooling=pooling, lora=lora)
        except LmplugError as exc:
            self.engine.constraints.unpin(rid)
            self._refuse(rid, index, prompt, group, exc)
            return
        except Exception as exc:
            self.engine.constraints.unpin(rid)
            logger.exception("add_request %s failed", rid)
            error = _server_error(exc)
            self._deliver([(group, Update(rid, index, len(prompt), [], True, error))], admission=error)
            return
        self._tracked[rid] = _Tracked(group, index, len(prompt), params.n, submitted_at)
        self.metrics.prompt_tokens.inc(len(prompt))
        self._deliver([], admitted=group)

    def _compile_first(self, rid: str, add: tuple) -> bool:
        """Start the request's constraint compiling in the pool, off this thread; True: the request
        waits (not in the engine) until the compile posts "compiled"."""
        params = add[3]
        if params.structured is None or add[6] is not None:
            return False
        future = self.engine.constraints.compile_async(params.structured)
        if future is None:
            return False
        self._compiling[rid] = add
        future.add_done_callback(lambda done: self._post(("compiled", rid, done)))
        return True

    def _compiled(self, rid: str, future) -> None:
        """The compile of a waiting request ended: admit the request, or refuse it with its error."""
        add = self._compiling.pop(rid, None)
        if add is None:  # aborted (client gone) while compiling
            return
        _, index, prompt, _, group, _, _, _ = add
        if future.exception() is not None:
            exc = future.exception()
            if isinstance(exc, LmplugError):
                self._refuse(rid, index, prompt, group, exc)
            else:
                error = _server_error(exc)
                self._deliver([(group, Update(rid, index, len(prompt), [], True, error))], admission=error)
            return
        self.engine.constraints.pin(rid, future.result())
        self._admit(*add)

    def _refuse(self, rid: str, index: int, prompt: list[int], group: RequestGroup, exc: LmplugError) -> None:
        error = group.on_refused(exc) if group.on_refused is not None else APIError(400, str(exc))
        self._deliver([(group, Update(rid, index, len(prompt), [], True, error))], admission=error)

    def _abort(self, rid: str) -> None:
        self._compiling.pop(rid, None)
        tracked = self._tracked.pop(rid, None)
        self.engine.abort_request(rid)
        if tracked is not None:
            self._observe_end(tracked, "abort", num_tokens=tracked.sent_tokens[0])

    def _cut_all(self) -> None:
        """Abort every request and tell its client: a last delta with ``finish_reason="abort"``;
        one still waiting for its compile is refused (503)."""
        for rid, (_, index, prompt, _, group, _, _) in list(self._compiling.items()):
            del self._compiling[rid]
            error = APIError(503, "the server is shutting down; retry on another instance")
            self._deliver([(group, Update(rid, index, len(prompt), [], True, error))], admission=error)
        out = []
        for rid, tracked in list(self._tracked.items()):
            self._abort(rid)
            choices = [ChoiceDelta(i, "", [], None, "abort") for i in range(tracked.n) if not tracked.done[i]]
            out.append((tracked.group, Update(rid, tracked.prompt_index, tracked.num_prompt_tokens, choices,
                                              True)))
        self._deliver(out)

    def _fail_all(self, exc: BaseException) -> None:
        error = _server_error(exc)
        out = []
        for rid, tracked in list(self._tracked.items()):
            del self._tracked[rid]
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s after an engine error failed", rid)
            self._observe_end(tracked, "error", num_tokens=tracked.sent_tokens[0])
            out.append((tracked.group, Update(rid, tracked.prompt_index, tracked.num_prompt_tokens, [],
                                              True, error)))
        self._deliver(out)
        self._publish_stats()

    def _step(self) -> None:
        outputs = self.engine.step()  # an exception fails the requests in flight (``_run``)
        now = time.perf_counter()
        out = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if isinstance(output, EmbeddingRequestOutput) and tracked is not None:
                out.append((tracked.group, self._embedding_update(output, tracked)))
            elif tracked is not None:
                update = self._update_for(output, tracked, now)
                if output.finished and any(c.finish_reason == "error" for c in output.outputs):
                    update = Update(output.request_id, tracked.prompt_index, tracked.num_prompt_tokens, [],
                                    True, _server_error(None))
                if update.choices or update.finished:
                    out.append((tracked.group, update))
        self._deliver(out)
        self.metrics.observe_stats(self.engine.last_stats)

    def _update_for(self, output: RequestOutput, tracked: _Tracked, now: float) -> Update:
        choices = []
        for c in output.outputs:
            i = c.index
            if tracked.done[i]:
                continue
            text, tokens = c.text[tracked.sent_text[i]:], c.token_ids[tracked.sent_tokens[i]:]
            if not (text or tokens or c.finish_reason):
                continue
            logprobs = c.logprobs[tracked.sent_tokens[i]:] if c.logprobs is not None else None
            choices.append(ChoiceDelta(i, text, list(tokens), logprobs, c.finish_reason))
            tracked.sent_text[i] += len(text)
            tracked.sent_tokens[i] += len(tokens)
            tracked.done[i] = c.finish_reason is not None
            self.metrics.generation_tokens.inc(len(tokens))
        if tracked.first_token_at is None and tracked.sent_tokens[0]:
            tracked.first_token_at = now
            self.metrics.ttft.observe(now - tracked.submitted_at)
        prompt_logprobs = None
        if output.prompt_logprobs is not None and choices and not tracked.sent_prompt_logprobs:
            prompt_logprobs, tracked.sent_prompt_logprobs = list(output.prompt_logprobs), True
        if output.finished:
            del self._tracked[output.request_id]
            self._observe_end(tracked, output.outputs[0].finish_reason or "stop", tracked.sent_tokens[0])
        return Update(output.request_id, tracked.prompt_index, tracked.num_prompt_tokens, choices,
                      output.finished, prompt_logprobs=prompt_logprobs,
                      metrics=output.metrics if output.finished else None)

    def _embedding_update(self, output: EmbeddingRequestOutput, tracked: _Tracked) -> Update:
        del self._tracked[output.request_id]
        self._observe_end(tracked, "stop", num_tokens=0)
        return Update(output.request_id, tracked.prompt_index, tracked.num_prompt_tokens, [], True,
                      embedding=output.outputs.embedding)

    def _observe_end(self, tracked: _Tracked, reason: str, num_tokens: int) -> None:
        elapsed = time.perf_counter() - tracked.submitted_at
        first = None if tracked.first_token_at is None else tracked.first_token_at - tracked.submitted_at
        self.metrics.observe_finished(reason, elapsed=elapsed, first_token_after=first, num_tokens=num_tokens)

    def _publish_stats(self) -> None:
        scheduler = self.engine.scheduler
        self.metrics.observe_stats({"kv_usage": self.engine.kv.usage, "num_running": scheduler.num_running,
                                    "num_waiting": scheduler.num_waiting})

    def _deliver(self, items: list[tuple[RequestGroup, Update]], *, admitted: RequestGroup | None = None,
                 admission: APIError | None = None) -> None:
        """Hand updates to the event loop; ``admitted``: a group one of whose requests the engine
        took; ``admission``: the error of the (one) refused request in ``items``."""
        if not (items or admitted) or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, items, admitted, admission)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the event loop: an engine-thread call's outcome into its future (unless cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(items: list[tuple[RequestGroup, Update]], admitted: RequestGroup | None,
             admission: APIError | None) -> None:
    if admitted is not None:
        admitted._admission(None)
    for group, update in items:
        if admission is not None:
            group._admission(admission)
        group.queue.put_nowait(update)


def _server_error(exc: BaseException | None) -> APIError:
    """A 500 for one request; ``None``: the engine ended it with ``finish_reason="error"`` (the
    cause is in the server log, not in the response)."""
    detail = "see the server log" if exc is None else f"{type(exc).__name__}: {exc}"
    return APIError(500, f"the engine failed while running this request ({detail})", code="engine_error")
