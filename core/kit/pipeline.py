"""Which decoder layers this process holds under pipeline parallelism, and how a stage's hidden
states travel to the next stage.

``PipelineStage`` reaches a model as ``ParallelState.stage``: the model builds its layers
``[start, end)`` only (the others are ``MissingLayer`` placeholders, so layer indices stay global:
per-layer windows, RoPE kinds and layer types read the same entries as on one process), the
embedding on the first stage, the final norm and the LM head on the last (a tied LM head: the
last stage loads its own copy of the embedding). ``whole()`` is one stage: every layer, no
transport. Ranks are laid out as vLLM does: global rank = stage * T + tp_rank, and each rank
exchanges hidden states with the rank of the same tp_rank in the neighbouring stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class StageClock:
    """How long this process waited for its input (the previous stage's hidden states, rank 0's
    logits, a worker's next step) since ``reset``: the pipeline's bubble, which the benchmark
    reports per stage. One per process: a process is one rank."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.started, self.wait_s = time.perf_counter(), 0.0

    def report(self) -> dict:
        wall = time.perf_counter() - self.started
        return {"wall_s": wall, "wait_s": self.wait_s, "bubble": self.wait_s / wall if wall > 0 else 0.0}


CLOCK = StageClock()


_SENDING: list = []  # this process's send in flight (its work and its tensor, kept alive until done)


def _send(x: torch.Tensor, dst: int) -> None:
    """Send without waiting for the receiver (the previous send is awaited first): a stage
    that sends batch B's hidden states while the last stage still sends it batch A's logits
    must not wait for B to be received (micro-batches in flight would deadlock)."""
    import torch.distributed as dist

    while _SENDING:
        _SENDING.pop()[0].wait()
    x = x.contiguous()
    _SENDING.append((dist.isend(x, dst=dst), x))


def forget_sends() -> None:
    """The process group is left: a send still in flight belongs to it (never waited on again)."""
    _SENDING.clear()


def _timed_recv(x: torch.Tensor, src: int) -> None:
    import torch.distributed as dist

    started = time.perf_counter()
    dist.recv(x, src=src)
    CLOCK.wait_s += time.perf_counter() - started


@dataclass(frozen=True)
class PipelineStage:
    stage: int = 0
    num_stages: int = 1
    start: int = 0  # first layer of this stage
    end: int | None = None  # one past its last layer (None: every layer)
    tp_size: int = 1  # ranks per stage (tensor parallel inside a stage)

    @property
    def split(self) -> bool:
        return self.num_stages > 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def owns(self, layer: int) -> bool:
        return self.start <= layer and (self.end is None or layer < self.end)

    def peer(self, tp_rank: int, stage: int) -> int:
        """The global rank of ``tp_rank`` in ``stage``."""
        return stage * self.tp_size + tp_rank

    # -- transport between stages (torch.distributed point-to-point: gloo on CPU, NCCL on GPUs) ----
    def receive(self, tp_rank: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """The previous stage's hidden states of this step."""
        x = torch.empty(shape, dtype=dtype, device=device)
        _timed_recv(x, self.peer(tp_rank, self.stage - 1))
        return x

    def send(self, tp_rank: int, x: torch.Tensor) -> None:
        """This stage's hidden states, to the next stage."""
        _send(x, self.peer(tp_rank, self.stage + 1))


_WHOLE = PipelineStage()


def whole() -> PipelineStage:
    """One stage holding every layer (no pipeline parallelism)."""
    return _WHOLE


class MissingLayer(torch.nn.Module):
    """A layer another stage holds: no weights; passes its input through (vLLM's ``PPMissingLayer``),
    so that a model's loop over ``self.layers`` runs only this stage's layers unchanged."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x


def stage_layers(stage: PipelineStage, count: int, make) -> torch.nn.ModuleList:
    """``count`` layers, ``make(i)`` for those this stage holds, ``MissingLayer`` for the others."""
    return torch.nn.ModuleList(make(i) if stage.owns(i) else MissingLayer() for i in range(count))


def foreign_layer(stage: PipelineStage, name: str, prefix: str) -> bool:
    """Whether checkpoint tensor ``name`` (``prefix`` + layer index + ...) belongs to a layer another
    stage holds: the loader skips it before the model looks at it."""
    if not stage.split or not name.startswith(prefix):
        return False
    index = name[len(prefix):].partition(".")[0]
    return index.isdigit() and not stage.owns(int(index))


def stage_input(parallel, embed, input_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The first stage's embedding of ``input_ids``; any other stage's: the hidden states the
    previous stage sends."""
    stage = parallel.stage
    if stage.first:
        return embed(input_ids)
    return stage.receive(parallel.rank, (input_ids.shape[0], hidden_size), dtype, input_ids.device)


def stage_output(parallel, x: torch.Tensor, norm) -> torch.Tensor | None:
    """The last stage's final-norm hidden states; any other stage sends ``x`` on and returns None."""
    stage = parallel.stage
    if stage.last:
        return norm(x)
    stage.send(parallel.rank, x)
    return None


def group_rows(where, num_tokens: int) -> int:
    """Rows of a step's logits group (a slice of the tokens or a list of row indices)."""
    return len(where) if isinstance(where, list) else len(range(num_tokens)[where])


def exchange_logits(parallel, model, hidden: torch.Tensor | None, groups: list, num_tokens: int,
                    vocab: int, device, defer: bool = False):
    """Each group's logits on global rank 0 (None elsewhere): the last stage computes them (its
    tensor-parallel ranks together) and its rank 0 sends them, float32, to the first stage's.
    ``defer``: rank 0 gets a callable that receives them later (a micro-batch in flight)."""
    stage = parallel.stage
    rows = [group_rows(where, num_tokens) for where in groups]
    if not sum(rows):
        return (lambda: [None] * len(groups)) if defer and stage.first else [None] * len(groups)
    if stage.last:
        logits = [model.compute_logits(hidden[where]) for where in groups]
        if parallel.rank == 0:
            out = torch.cat([lg.float() for lg in logits])
            if out.shape[-1] != vocab:
                raise RuntimeError(f"pipeline: the last stage's logits have {out.shape[-1]} columns, "
                                   f"the vocabulary {vocab}")
            _send(out, stage.peer(0, 0))
        return [None] * len(groups)
    if not (stage.first and parallel.rank == 0):
        return [None] * len(groups)

    def receive() -> list[torch.Tensor]:
        out = torch.empty(sum(rows), vocab, dtype=torch.float32, device=device)
        _timed_recv(out, stage.peer(0, stage.num_stages - 1))
        return list(out.split(rows))

    return receive if defer else receive()
