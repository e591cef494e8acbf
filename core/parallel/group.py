"""What rank 0 and the workers of a tensor- or pipeline-parallel group share: joining and leaving
the process group, the stop message, and moving a step's context between devices."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os

import torch

from lmplug.kit.parallel import ParallelState

STOP = None  # the message that ends a worker's loop
CLOCK_RESET, CLOCK_REPORT = "clock-reset", "clock-report"  # the stage clocks (``lmplug.kit.pipeline``)


def init_rank(rank: int, world_size: int, init_method: str | None, backend: str,
              timeout_s: float, expert_parallel: bool = False, pipeline: list[int] | None = None) -> ParallelState:
    """Join the default process group (and, over NCCL, a gloo group for pickled messages).
    ``expert_parallel``: MoE experts are split whole across the ranks (``parallel.expert_parallel``).
    ``pipeline``: layers per stage (pipeline parallel; ``world_size / len(pipeline)`` ranks per stage,
    each stage's tensor-parallel collectives in a group of its own)."""
    import torch.distributed as dist

    from lmplug.parallel.pipeline import stage_of

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    kwargs = {"init_method": init_method} if init_method else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    if not pipeline or len(pipeline) == 1:
        return ParallelState(rank, world_size, expert_parallel=expert_parallel, cpu_group=cpu_group)
    tp = world_size // len(pipeline)
    # every rank creates every stage's group, in the same order (torch.distributed's rule)
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if tp > 1 else None for s in range(len(pipeline))]
    stage = stage_of(rank, pipeline, tp)
    return ParallelState(rank % tp, tp, expert_parallel=expert_parallel, cpu_group=cpu_group,
                         stage=stage, group=groups[stage.stage])


def expert_parallel(payload: dict) -> bool:
    """``parallel.expert_parallel`` of the engine config a group is started with."""
    return bool(payload["config"].get("parallel", {}).get("expert_parallel", False))


def rank_layout(payload: dict) -> dict:
    """``init_rank``'s keywords for the group a payload starts: expert parallel, the stages' layers."""
    return {"expert_parallel": expert_parallel(payload), "pipeline": payload.get("pipeline")}


def clock_message(msg, state: ParallelState) -> bool:
    """A worker's answer to rank 0's stage-clock messages (True: ``msg`` was one)."""
    from lmplug.kit.pipeline import CLOCK

    if msg == CLOCK_RESET:
        CLOCK.reset()
    elif msg == CLOCK_REPORT:
        state.all_gather_object(CLOCK.report())
    else:
        return False
    return True


def leave_group() -> None:
    import torch.distributed as dist

    from lmplug.kit.pipeline import forget_sends

    forget_sends()

    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError):  # a broken group: nothing more to release
            dist.destroy_process_group()


def ctx_to(ctx, device):
    """``StepContext`` with its tensors on ``device`` (host copies travel between ranks)."""
    return dataclasses.replace(ctx, **{f.name: getattr(ctx, f.name).to(device)
                                       for f in dataclasses.fields(ctx)
                                       if isinstance(getattr(ctx, f.name), torch.Tensor)})
