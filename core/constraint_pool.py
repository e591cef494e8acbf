"""Constraint compiles off the engine thread, in worker processes that can be killed.

A client's schema, regex or grammar can take the grammar engine seconds to compile (4,096 long
choices, a 100k-value enum, a 490-deep schema), and neither xgrammar (0.2.9) nor llguidance (1.9)
offers a way to cancel a compile: a thread that runs one cannot be stopped, so a compile past
``max_compile_s`` would keep its core busy. Each compile is therefore tried first in a worker
process (spawned, holding its own copy of the backend): one past ``max_compile_s`` is abandoned by
killing the worker (its CPU use stops at once; a fresh worker replaces it) and refused with an error
naming the limit; one the backend refuses is refused with the backend's error. The limits checked
before any compile (``check_before_compile``) run on the pool's thread too.

What comes back is the verdict, not the compiled grammar: xgrammar's ``CompiledGrammar`` can be
serialised (``serialize_json``), but writing and reading it back costs more than compiling again
(measured with 512 long choices: 9.0 s + 6.1 s against 3.9 s, a 193 MB text for 4,096), and
llguidance's matcher cannot be serialised at all. So once the worker has shown that a constraint
compiles in time, this process compiles it again on the pool's own thread (both engines release
the GIL while compiling) and puts it in the backend's cache; the engine thread never compiles.

A compiled grammar can take hundreds of MB (xgrammar: 200 MB for a 100k-value enum); the cache
drops it past ``cache_bytes``, but glibc keeps the freed pages of the pool thread's heap, so after
each compile the heap is trimmed (``malloc_trim``) and the process's memory falls back.

Jobs wait in a bounded queue (``compile_queue``; a full queue refuses the request); equal
constraints asked for at once share one job.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import multiprocessing
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from lmplug.interfaces.constraint import (
    ConstraintBackend,
    ConstraintError,
    ConstraintTokenizer,
    StructuredOutput,
)
from lmplug.interfaces.constraint_checks import check_before_compile

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0  # a fresh worker imports the engine and reads the vocabulary


class CompilePool:
    def __init__(self, backend: ConstraintBackend, workers: int, queue_size: int) -> None:
        self.backend = backend
        self._jobs: queue.Queue[tuple[StructuredOutput, Future] | None] = queue.Queue(maxsize=queue_size)
        self._inflight: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [_Worker(backend) for _ in range(workers)]
        for i, worker in enumerate(self._workers):
            threading.Thread(target=self._serve, args=(worker,), name=f"lmplug-constraint-pool-{i}",
                             daemon=True).start()

    def submit(self, spec: StructuredOutput) -> Future:
        """A future of the compiled constraint (in this process, cached by the backend), or of the
        ``ConstraintError`` that refuses it."""
        with self._lock:
            future = self._inflight.get(spec.key)
            if future is not None:
                return future
            future = Future()
            try:
                self._jobs.put_nowait((spec, future))
            except queue.Full:
                raise ConstraintError(spec.kind, f"structured output {spec.kind}: {self._jobs.maxsize} "
                                      "constraints are waiting to compile (structured_output.compile_queue); "
                                      "retry later") from None
            self._inflight[spec.key] = future
        # no reference to the future in its own callback: a cycle would keep its result (hundreds
        # of MB of grammar, maybe dropped from the cache already) until Python's cyclic collector ran
        future.add_done_callback(functools.partial(self._forget, spec.key))
        return future

    def close(self) -> None:
        """Kill the workers and end the threads serving them (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.stop()
        for _ in self._workers:  # wake the threads waiting for a job: they see the pool closed
            try:
                self._jobs.put_nowait(None)
            except queue.Full:
                break

    def _forget(self, key: tuple, future: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def _serve(self, worker: _Worker) -> None:
        worker.start()  # at once: the first constrained request does not wait for the set-up
        if self._closed:  # closed while it started
            worker.stop()
            return
        while not self._closed:
            job = self._jobs.get()
            if job is None:
                break
            spec, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                # here, not on the engine thread: walking a 100k-value enum takes a while
                check_before_compile(spec, self.backend.options)
                worker.check(spec, self.backend.options.max_compile_s)
                future.set_result(self.backend.compile_cached(spec))
            except ConstraintError as exc:
                future.set_exception(exc)
            except Exception as exc:
                logger.exception("structured output: compiling a %s constraint failed", spec.kind)
                future.set_exception(exc)
            del spec, future  # the compiled grammar belongs to the cache and its request from here on
            trim_heap()


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc only; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


class _Worker:
    """One worker process and the pipe to it; ``check`` kills and replaces it on a timeout."""

    def __init__(self, backend: ConstraintBackend) -> None:
        self.backend = backend
        self._process: Any = None
        self._conn: Any = None
        self._ready = False  # the worker has said "ready" (its set-up is done)
        self._broken: tuple[str, str] | None = None  # the worker's set-up failed: (field, message)

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs torch threads
        ours, theirs = ctx.Pipe()
        tok = self.backend.tokenizer
        # the worker only validates: no cache, and no time limit of its own (this process kills it)
        options = self.backend.options.model_copy(update={"max_compile_s": 1e9, "cache_size": 1,
                                                          "cache_bytes": 1})
        self._process = ctx.Process(
            target=_worker_main, name=f"lmplug-{self.backend.name}-compile", daemon=True,
            args=(theirs, type(self.backend), options, tok.tokenizer.to_str(), tok.vocab_size,
                  sorted(tok.eos_token_ids)))
        self._process.start()
        theirs.close()
        self._conn, self._ready = ours, False

    def stop(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def check(self, spec: StructuredOutput, seconds: float) -> None:
        """Compile ``spec`` in the worker; raise ``ConstraintError`` if it refuses it or takes
        longer than ``seconds`` (then the worker is killed, its CPU use stops, and it is replaced)."""
        if self._broken is None and (self._process is None or not self._process.is_alive()):
            self.stop()
            self.start()
        self._wait_ready()
        self._conn.send(spec)
        started = time.monotonic()
        if not self._conn.poll(seconds):
            self.stop()
            self.start()
            raise ConstraintError(spec.kind, f"structured output {spec.kind}: compiling it with "
                                  f"{self.backend.name} took longer than structured_output.max_compile_s = "
                                  f"{seconds:g} s; refused and stopped (simplify it, or raise the limit)")
        try:
            verdict = self._conn.recv()
        except (EOFError, OSError):
            code = self._process.exitcode if self._process is not None else None
            self.stop()
            raise ConstraintError(spec.kind, f"structured output {spec.kind}: the {self.backend.name} "
                                  f"compile worker died after {time.monotonic() - started:.1f} s (exit code "
                                  f"{code}) compiling it; refused") from None
        if verdict is not None:
            raise ConstraintError(*verdict)

    def _wait_ready(self) -> None:
        if self._ready:
            return
        if self._broken is not None:
            raise ConstraintError(*self._broken)
        try:
            ready = self._conn.poll(READY_TIMEOUT_S) and self._conn.recv()
        except (EOFError, OSError):
            ready = None
        if isinstance(ready, tuple):  # the backend cannot work here at all: say so to every request
            self._broken = ready
            raise ConstraintError(*ready)
        if ready != "ready":
            self.stop()
            raise ConstraintError("structured", f"structured output: the {self.backend.name} compile worker "
                                  "could not start (see the server log)")
        self._ready = True


def _worker_main(conn, backend_cls: type[ConstraintBackend], options, tokenizer_json: str, vocab_size: int,
                 eos_ids: list[int]) -> None:
    """The worker process: build the backend, say "ready", then answer each constraint with None
    (it compiles) or ``(field, message)`` (it is refused)."""
    from tokenizers import Tokenizer

    backend = backend_cls(options, ConstraintTokenizer(Tokenizer.from_str(tokenizer_json), vocab_size,
                                                       frozenset(eos_ids)))
    try:
        backend.prepare()
    except ConstraintError as exc:  # e.g. a tokenizer the engine cannot read: every request's answer
        with contextlib.suppress(OSError):
            conn.send((exc.field, str(exc)))
        return
    except Exception:
        logging.getLogger(__name__).exception("the %s compile worker could not start", backend.name)
        return
    try:
        conn.send("ready")
    except OSError:  # the engine went away while this worker started (a broken pipe)
        return
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            backend.compile_cached(spec)
            verdict = None
        except ConstraintError as exc:
            verdict = (exc.field, str(exc))
        except Exception as exc:  # noqa: BLE001 - the engine's own error: the request is refused
            verdict = (spec.kind, f"structured output {spec.kind}: {backend.name} cannot compile it: {exc}")
        trim_heap()  # the compiled grammar is not kept here
        try:
            conn.send(verdict)
        except OSError:  # the engine went away (or gave up on this compile)
            return
