"""A tensor- or pipeline-parallel worker (ranks 1..N-1): build the model's shard or stage, then run
rank 0's steps (a pipeline stage receives its input from the previous stage and sends its output
on inside ``ModelRunner.run``; see ``lmplug.kit.pipeline``).

The worker re-resolves the engine config it was given and builds the same parts as rank 0
(the payload's ``build``, which the engine hands ``setup.start``, with its ``ParallelState``:
local heads, its slice of every weight, a KV cache with its KV heads only). Then, until the stop message: receive the step's inputs (input ids,
``StepContext``, the rows that need logits, LoRA slots) broadcast by rank 0 and run ``ModelRunner.run`` on
them; the row-parallel all-reduces and the logits gather meet rank 0's. A failure is sent to rank
0 (through a pipe) before the process exits; a worker whose parent dies exits within a second.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time

from lmplug.kit.pipeline import CLOCK
from lmplug.parallel.group import STOP, clock_message, ctx_to, init_rank, leave_group, rank_layout


def worker_main(rank: int, world_size: int, init_method: str | None, backend: str, timeout_s: float,
                payload: dict, errors, steps) -> None:
    """Entry point of a spawned worker (``launch.WorkerGroup``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING)
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock, which os._exit would leak
    try:
        state = init_rank(rank, world_size, init_method, backend, timeout_s, **rank_layout(payload))
        serve(state, payload, lambda: pickle.loads(steps.recv_bytes()))
    except BaseException as exc:  # noqa: BLE001 (tell rank 0 why, then go)
        try:
            errors.send(f"{type(exc).__name__}: {exc}")
        finally:
            os._exit(1)
    os._exit(0)  # skip interpreter teardown: the group is left, nothing else to flush


def serve(state, payload: dict, receive=None) -> None:
    """Build this rank's parts and run steps until rank 0 says stop. ``receive``: the next step
    message (a spawned worker's pipe); None: broadcast over the group (torchrun ranks)."""
    from lmplug.config import EngineConfig, resolve

    config = EngineConfig.from_dict(payload["config"], source=payload["source"])
    resolved = resolve(config, device=payload["device"], dtype=payload["dtype"], source=payload["source"])
    parts = payload["build"](resolved, parallel=state)
    runner, device = parts.runner, parts.runner.device
    receive = receive or state.broadcast_object
    while True:
        waited = time.perf_counter()
        msg = receive()  # EOFError when rank 0 is gone
        CLOCK.wait_s += time.perf_counter() - waited
        if msg is STOP:
            break
        if clock_message(msg, state):
            continue
        input_ids, ctx, groups, copies, lora = msg
        if copies is not None:  # rank 0's cache copied blocks or rows (beam forks): the same here
            parts.kv.apply_copies(copies)
        if lora is not None:  # rank 0's adapter slots and this step's token -> slot map
            runner.adapters.replay(lora, device)
        runner.run(input_ids.to(device), ctx_to(ctx, device), groups)
    leave_group()


def _exit_with_parent() -> None:
    """Exit when rank 0's process is gone (it may have been killed before it could stop us)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="lmplug-tp-parent", daemon=True).start()
