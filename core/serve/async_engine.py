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

The event-loop side is here; the engine thread is ``engine_thread.py`` and what a handler
holds is ``request_group.py``.

``max_num_seqs``: sequences (n x prompts) all open requests may hold together;
a request past it gets a 429 (``too_many_sequences``) and may retry later.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from lmplug.engine.engine import LLMEngine
from lmplug.errors import LmplugError
from lmplug.interfaces.adapter import LoRARequest
from lmplug.interfaces.params import SamplingParams
from lmplug.outputs import PoolingParams
from lmplug.serve.engine_thread import EngineThread, Tracked
from lmplug.serve.errors import APIError
from lmplug.serve.metrics import Metrics
from lmplug.serve.request_group import RequestGroup

logger = logging.getLogger(__name__)


class AsyncEngine(EngineThread):
    """The server's handle on the engine: start / stop / drain, and requests posted to its thread."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None, *, idle_wait_s: float = 0.5,
                 max_num_seqs: int | None = None) -> None:
        self.engine = engine
        self.max_num_seqs = max_num_seqs  # None: no server-wide limit
        self.metrics = metrics or Metrics()
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracked: dict[str, Tracked] = {}  # engine thread only
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
