"""Starting a tensor- or pipeline-parallel group: rank 0 spawns the other ranks (N-1, or P x T - 1),
or every rank joins a torchrun launch.

Rank 0 is the engine's own process. ``WorkerGroup`` spawns the workers (``torch.multiprocessing``
spawn context, daemonic), meets them at a free TCP port on loopback and keeps a watchdog thread
on their process sentinels: when a worker dies, the others are killed at once and the next (or
current) step raises ``TensorParallelError`` naming the rank and its exit code or signal, with the
worker's own error when it sent one. A collective that fails because a peer vanished is turned
into the same error. ``close`` (engine close, or ``atexit``) stops and joins every worker.

Scripts that build a tensor-parallel engine at import time must guard it with
``if __name__ == "__main__":`` (the spawn start method imports the main module in each worker).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import signal
import socket
import threading
import time
from multiprocessing.connection import wait as wait_sentinels

import torch

from lmplug.kit.kv_extras import take_copies
from lmplug.kit.parallel import ParallelState, TensorParallelError
from lmplug.kit.pipeline import CLOCK
from lmplug.parallel.group import (
    CLOCK_REPORT,
    CLOCK_RESET,
    STOP,
    ctx_to,
    init_rank,
    leave_group,
    rank_layout,
)
from lmplug.parallel.worker import worker_main

logger = logging.getLogger(__name__)

def torchrun_rank(tp: int, pp: int = 1) -> int | None:
    """This process's rank when it was started by ``torchrun`` for ``pp x tp`` processes."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != tp * pp:
        from lmplug.errors import ConfigError
        from lmplug.parallel.pipeline import check_sizes

        check_sizes(pp, tp, int(os.environ["WORLD_SIZE"]))  # names both sizes under pipeline parallelism
        raise ConfigError(f"parallel.tensor_parallel_size is {tp}, but torchrun started "
                          f"WORLD_SIZE={os.environ['WORLD_SIZE']} processes; make them equal")
    return int(os.environ["RANK"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _describe_group(payload: dict) -> str:
    stages = payload.get("pipeline")
    return f"pipeline parallel (layers per stage {stages})" if stages else "tensor parallel"


class WorkerGroup:
    """Rank 0's side of a tensor- or pipeline-parallel group (``state``: rank 0's ``ParallelState``)."""

    def __init__(self, payload: dict, world_size: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp


        if dist.is_initialized():  # the group is the process's default group: one at a time
            raise TensorParallelError("a tensor-parallel engine is already running in this process; "
                                      "close it first (LLM.close() / LLMEngine.close())")

        self.world_size = world_size
        self.pipeline = payload.get("pipeline")  # layers per stage (None: tensor parallel only)
        self.failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._reasons: dict[int, str] = {}  # rank -> the error a worker sent before exiting
        self._pipes = {}
        # steps travel through one pipe per worker, not a collective: a worker may wait for the
        # next step forever (an idle server), and sees EOF at once when rank 0 dies
        self._steps: list | None = []
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs = {}
        for rank in range(1, world_size):
            reader, writer = ctx.Pipe(duplex=False)
            step_reader, step_writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, name=f"lmplug-parallel-rank{rank}", daemon=True,
                               args=(rank, world_size, init_method, backend, timeout_s, payload, writer,
                                     step_reader))
            proc.start()
            writer.close()
            step_reader.close()
            self.procs[rank], self._pipes[rank] = proc, reader
            self._steps.append(step_writer)
        atexit.register(self.close)
        self._watchdog = threading.Thread(target=self._watch, name="lmplug-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self.state = self._join(init_method, backend, timeout_s, rank_layout(payload))
        except BaseException:
            self.close()
            raise
        logger.info("%s: %d ranks over %s (workers %s)", _describe_group(payload), world_size, backend,
                    ", ".join(f"{r}: pid {p.pid}" for r, p in self.procs.items()))

    @classmethod
    def joined(cls, state: ParallelState) -> WorkerGroup:
        """Rank 0 of a ``torchrun`` launch: the other ranks are not our children (a dead one
        shows as a failed collective)."""
        group = cls.__new__(cls)
        group.world_size, group.state, group.failure, group._closed = state.world_size, state, None, False
        group.pipeline = None  # a dead rank shows as a failed collective, not by its stage
        group._lock, group.procs, group._reasons, group._pipes = threading.Lock(), {}, {}, {}
        group._steps = None  # steps are broadcast over the group (torchrun ranks are not our children)
        atexit.register(group.close)
        return group

    # -- start-up ------------------------------------------------------------------------------
    def _join(self, init_method: str, backend: str, timeout_s: float, layout: dict) -> ParallelState:
        """Rank 0 joins the group in a helper thread, so a worker that dies first is reported
        at once instead of after the rendezvous timeout."""
        box: dict = {}

        def join() -> None:
            try:
                box["state"] = init_rank(0, self.world_size, init_method, backend, timeout_s, **layout)
            except BaseException as exc:  # noqa: BLE001 (re-raised by the waiting thread)
                box["error"] = exc

        thread = threading.Thread(target=join, name="lmplug-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if self.failure is not None:
                raise TensorParallelError(self.failure)
        if "error" in box:
            raise box["error"]
        return box["state"]

    # -- the watchdog ---------------------------------------------------------------------------
    def _watch(self) -> None:
        pending = {proc.sentinel: rank for rank, proc in self.procs.items()}
        while pending and not self._closed:
            for sentinel in wait_sentinels(list(pending), timeout=0.5):
                rank = pending.pop(sentinel)
                if not self._closed:
                    self._fail(rank)

    def _fail(self, rank: int) -> None:
        proc = self.procs[rank]
        proc.join(1.0)
        try:
            if self._pipes[rank].poll():
                self._reasons[rank] = self._pipes[rank].recv()
        except (EOFError, OSError):  # it died without a word
            pass
        with self._lock:
            if self.failure is not None or self._closed:
                return
        why = self._reasons.get(rank)
        failure = (f"{self._role(rank)} (pid {proc.pid}) {_describe_exit(proc.exitcode)}"
                   + (f": {why}" if why else "") + "; the other ranks were stopped")
        self._kill_all()  # before the failure is published: whoever raises it finds the others gone
        with self._lock:
            if self.failure is None:
                self.failure = failure
        logger.error("%s", self.failure)

    def _role(self, rank: int) -> str:
        """How a worker is named in errors: with its pipeline stage, when there are stages."""
        if not self.pipeline:
            return f"tensor-parallel worker rank {rank}"
        stage = rank // (self.world_size // len(self.pipeline))
        return f"pipeline-parallel worker rank {rank} (stage {stage} of {len(self.pipeline)})"

    def _kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(5.0)

    # -- steps ------------------------------------------------------------------------------------
    def check(self) -> None:
        if self.failure is not None:
            self.close()  # every worker stopped and joined before the error reaches the caller
            raise TensorParallelError(self.failure)
        if self._closed:
            raise TensorParallelError("the tensor-parallel group is closed")

    def run_step(self, runner, input_ids: torch.Tensor, ctx, groups: list):
        """Broadcast the step's inputs (and the KV copies rank 0's cache made since the last
        step, which every rank repeats first; with LoRA, the adapter slots filled and each token's
        slot: ``Adapters.take_message``), then run rank 0's shard of it (``ModelRunner.run``)."""
        self.check()
        try:
            lora = runner.adapters.take_message() if runner.adapters is not None else None
            self._send((input_ids.cpu(), ctx_to(ctx, "cpu"), groups, take_copies(runner.kv), lora))
            return runner.run(input_ids, ctx, groups)
        except BaseException as exc:  # Ctrl-C mid-step too: the ranks are out of step
            error = self._step_error(exc)
            if error is exc:
                raise
            raise error from exc

    def finish_step(self, receive):
        """``receive()``: the logits of a pipeline step submitted earlier; a failure is the step's."""
        try:
            return receive()
        except BaseException as exc:
            error = self._step_error(exc)
            if error is exc:
                raise
            raise error from exc

    def stage_clocks(self, reset: bool = False) -> list[dict] | None:
        """Every rank's wait for its input since the last reset (``lmplug.kit.pipeline.StageClock``:
        wall_s, wait_s, bubble), by global rank; ``reset``: start the clocks again (returns None)."""
        self.check()
        self._send(CLOCK_RESET if reset else CLOCK_REPORT)
        if reset:
            CLOCK.reset()
            return None
        return self.state.all_gather_object(CLOCK.report())

    def _send(self, msg) -> None:
        if self._steps is None:
            self.state.broadcast_object(msg)
            return
        data = pickle.dumps(msg)  # plain pickle: tensors as bytes, not torch's shared-memory handles
        for conn in self._steps:
            conn.send_bytes(data)

    def _step_error(self, exc: Exception) -> Exception:
        """A collective failed, or rank 0's own forward did. Either way the ranks are out of step:
        stop them. A worker that died is the error to report (the watchdog names it)."""
        deadline = time.monotonic() + 3.0
        while self.failure is None and time.monotonic() < deadline and \
                isinstance(exc, RuntimeError):
            time.sleep(0.05)
        failure = self.failure
        self.close()
        if failure is not None:
            return TensorParallelError(failure)
        return exc

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell the workers to stop, join them (kill what does not exit), leave the group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        healthy = self.failure is None and all(p.is_alive() for p in self.procs.values())
        if healthy and hasattr(self, "state"):
            with contextlib.suppress(RuntimeError, OSError):  # a worker died meanwhile; it is killed below
                self._send(STOP)
        for proc in self.procs.values():
            proc.join(5.0 if healthy else 0.1)
        self._kill_all()
        leave_group()
