"""The pipeline's stage plan: which contiguous layers each stage holds, checked at load.

``parallel.pipeline_parallel_size: P`` splits the decoder layers into P stages; ``pipeline_layers``
sets each stage's count, else the split is even with the remainder to the first stages. With
``tensor_parallel_size: T`` every stage runs on T ranks (P x T processes, global rank =
stage * T + tp_rank, as vLLM lays them out).
"""

from __future__ import annotations

from lmplug.errors import ConfigError
from lmplug.kit.pipeline import PipelineStage

OPTION = "parallel.pipeline_parallel_size"
LAYERS_OPTION = "parallel.pipeline_layers"


def layer_counts(num_layers: int, stages: int, pipeline_layers: list[int] | None, where: str) -> list[int]:
    """Layers per stage, first stage first; ``ConfigError`` naming the option and the numbers
    when the model's ``num_layers`` cannot be split so."""
    if stages > num_layers:
        raise ConfigError(f"{OPTION}={stages} is more than the {num_layers} layers of {where}: each stage "
                          f"needs at least one layer; choose at most {num_layers} stages")
    if pipeline_layers is None:
        base, extra = divmod(num_layers, stages)
        return [base + (1 if s < extra else 0) for s in range(stages)]
    counts = list(pipeline_layers)
    if len(counts) != stages:
        raise ConfigError(f"{LAYERS_OPTION} lists {len(counts)} stages {counts}, but {OPTION} is {stages}; "
                          "give one layer count per stage")
    if any(c < 1 for c in counts):
        raise ConfigError(f"{LAYERS_OPTION} {counts}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ConfigError(f"{LAYERS_OPTION} {counts} sums to {sum(counts)} layers, but {where} has "
                          f"{num_layers}; the counts must add up to the model's layers")
    return counts


def stage_of(rank: int, counts: list[int], tp_size: int) -> PipelineStage:
    """The stage of global rank ``rank`` (stage = rank // T) and its layers."""
    stage = rank // tp_size
    start = sum(counts[:stage])
    return PipelineStage(stage, len(counts), start, start + counts[stage], tp_size)


def check_sizes(pp: int, tp: int, world_size: int | None) -> None:
    """Under ``torchrun``, P x T must be the processes it started (``WORLD_SIZE``; P = 1: tensor
    parallelism's own message)."""
    if pp > 1 and world_size is not None and pp * tp != world_size:
        raise ConfigError(f"{OPTION}={pp} x parallel.tensor_parallel_size={tp} = {pp * tp} processes, but "
                          f"torchrun started WORLD_SIZE={world_size}; make P x T equal the processes launched")
