"""The engine thread of ``AsyncEngine``: commands applied between steps, steps, deltas out.

Everything here runs on the one thread that owns the ``LLMEngine`` (``async_engine.py`` explains
why): it takes the commands handlers post (add, compiled, abort, cut, call), admits or refuses
requests (a structured request waits outside the engine while its constraint compiles), steps
the engine and turns each ``RequestOutput`` into the per-choice ``Update`` its ``RequestGroup``
receives on the event loop. A mixin of ``AsyncEngine``, apart from its event-loop API, so each
side reads on its own.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmplug.engine.engine import LLMEngine
from lmplug.errors import LmplugError
from lmplug.interfaces.adapter import LoRARequest
from lmplug.interfaces.params import SamplingParams
from lmplug.outputs import EmbeddingRequestOutput, PoolingParams, RequestOutput
from lmplug.serve.errors import APIError
from lmplug.serve.metrics import Metrics
from lmplug.serve.request_group import ChoiceDelta, RequestGroup, Update

logger = logging.getLogger("lmplug.serve.async_engine")  # the name its records had before the split


@dataclass
class Tracked:
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



class EngineThread:
    """The engine thread's half of ``AsyncEngine`` (which sets these attributes)."""

    engine: LLMEngine
    metrics: Metrics
    idle_wait_s: float
    _commands: queue.SimpleQueue[tuple]
    _wake: threading.Event
    _tracked: dict[str, Tracked]  # engine thread only
    _compiling: dict[str, tuple]  # engine thread only: "add" commands waiting for a compile
    _loop: asyncio.AbstractEventLoop | None
    _stopping: bool

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

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
        self._tracked[rid] = Tracked(group, index, len(prompt), params.n, submitted_at)
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

    def _update_for(self, output: RequestOutput, tracked: Tracked, now: float) -> Update:
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

    def _embedding_update(self, output: EmbeddingRequestOutput, tracked: Tracked) -> Update:
        del self._tracked[output.request_id]
        self._observe_end(tracked, "stop", num_tokens=0)
        return Update(output.request_id, tracked.prompt_index, tracked.num_prompt_tokens, [], True,
                      embedding=output.outputs.embedding)

    def _observe_end(self, tracked: Tracked, reason: str, num_tokens: int) -> None:
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