"""Who this process is in a tensor-parallel group, and the few collectives the model uses.

``ParallelState`` is passed explicitly: the engine build hands it to the model, whose layers read
their local sizes (heads, slices, experts) from it, and to the loader. The default, ``single()``,
is one process: every collective is a no-op. Under pipeline parallelism ``stage`` says which
layers this process holds (``lmplug.kit.pipeline``); ``rank`` and ``world_size`` stay those of the
tensor-parallel group inside the stage (``group``; None: the default group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lmplug.errors import LmplugError
from lmplug.kit.pipeline import PipelineStage, whole


class TensorParallelError(LmplugError):
    """A tensor- or pipeline-parallel worker failed or died; the group is stopped."""


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    # MoE experts: whole experts per rank (expert parallel) instead of a slice of every expert's width
    expert_parallel: bool = False
    # process group for pickled control messages (gloo; None: the default group)
    cpu_group: Any = field(default=None, compare=False)
    # pipeline parallel: this process's stage (its layers); tensor-parallel collectives run in
    # ``group``, the ranks of this stage (None: the default group, every rank)
    stage: PipelineStage = field(default_factory=whole)
    group: Any = field(default=None, compare=False)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def is_distributed(self) -> bool:
        """More than one process: tensor- or pipeline-parallel."""
        return self.world_size > 1 or self.stage.split

    @property
    def global_rank(self) -> int:
        """This process's rank among every stage's ranks (stage * T + rank)."""
        return self.stage.peer(self.rank, self.stage.stage)

    # -- how a size splits ------------------------------------------------------------------
    def split(self, total: int) -> tuple[int, int]:
        """This rank's ``(start, size)`` of ``total`` features that divide evenly."""
        size = total // self.world_size
        return self.rank * size, size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """``(first KV head, local KV heads)``: split when N divides them, else each rank keeps
        the one head its query heads read (replicated across ``N / num_kv_heads`` ranks)."""
        if num_kv_heads % self.world_size == 0:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.world_size, 1

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """``(first expert, local experts)``: whole experts ``[rank*E/N, (rank+1)*E/N)`` under expert
        parallelism (E divisible by N, checked at load), else all of them."""
        return self.split(num_experts) if self.expert_parallel else (0, num_experts)

    def expert_width(self, intermediate: int) -> int:
        """Each local expert's intermediate size: whole under expert parallelism, else 1/N of it."""
        return intermediate if self.expert_parallel else intermediate // self.world_size

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """``(start, local rows)`` of the vocabulary padded to a multiple of N."""
        local = -(-vocab // self.world_size)
        return self.rank * local, local

    # -- collectives (no-ops on one process) --------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last axis on the stage's rank 0; other ranks get None."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.stage.peer(0, self.stage.stage), group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Global rank 0's ``obj`` on every rank of every stage (pickled; for per-step inputs and
        control messages)."""
        if not self.is_distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (of every stage), by global rank."""
        if not self.is_distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


_SINGLE = ParallelState()


def single() -> ParallelState:
    return _SINGLE
