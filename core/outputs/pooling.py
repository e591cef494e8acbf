"""Embeddings: a prompt's final-norm hidden states pooled into one vector (vLLM's pooling runner).

An embedding request is a prefill-only sequence (``Sequence.pooling`` names its pooling type):
the runner hands the final hidden states of its rows to ``Pooler.take`` and never runs the LM
head on them; when its prompt is complete the vector is made and the sequence ends without
sampling. A prompt prefilled in chunks is pooled chunk by chunk; a recompute from position 0
(preemption) starts the pool again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lmplug.errors import ConfigError
from lmplug.interfaces.sequence import Sequence
from lmplug.outputs.types import RequestMetrics

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """How one embedding request pools; None: the config's ``pooler`` section."""

    pooling_type: str | None = None  # last | mean | cls (vLLM's LAST / MEAN / CLS)
    normalize: bool | None = None  # unit L2 norm
    dimensions: int | None = None  # Matryoshka: keep the first ``dimensions`` (where the model declares it)

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).lower()
            if kind not in POOLING_TYPES:
                raise ConfigError(f"pooling_type: {self.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
            object.__setattr__(self, "pooling_type", kind)

    def with_defaults(self, pooling_type: str, normalize: bool) -> PoolingParams:
        return replace(self, pooling_type=self.pooling_type or pooling_type,
                       normalize=normalize if self.normalize is None else self.normalize)


def truncate(vector: list[float], pooling: PoolingParams) -> list[float]:
    """Matryoshka: the vector's first ``dimensions`` values, renormalized when the request normalizes
    (normalizing the whole vector first changes nothing: the head's norm is rescaled anyway)."""
    if pooling.dimensions is None or pooling.dimensions >= len(vector):
        return vector
    head = torch.tensor(vector[:pooling.dimensions])
    return (torch.nn.functional.normalize(head, dim=0) if pooling.normalize else head).tolist()


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's shape: ``.outputs.embedding``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None


class Pooler:
    """Each pooling sequence's partial pool, summed in float32 across its prompt's chunks."""

    def __init__(self) -> None:
        self._parts: dict[int, list] = {}  # seq_id -> [vector, tokens pooled]

    def take(self, pooled: dict[int, tuple[int, torch.Tensor]], seqs: list[Sequence]) -> list[tuple[Sequence, list[float]]]:
        """Pool this step's rows (seq_id -> (first position, hidden [n, h])); return the sequences
        whose prompt is now complete, with their vectors. Call after the computed counts advanced."""
        done = []
        by_id = {s.seq_id: s for s in seqs}
        for seq_id, (first, hidden) in pooled.items():
            seq = by_id[seq_id]
            self._add(seq, first, hidden)
            if seq.num_computed_tokens >= seq.num_tokens:
                done.append((seq, self._finish(seq)))
        return done

    def _add(self, seq: Sequence, first: int, hidden: torch.Tensor) -> None:
        rows = hidden.float()
        part = self._parts.get(seq.seq_id)
        if part is None or first == 0:  # a new prompt, or its recompute after preemption
            part = self._parts[seq.seq_id] = [torch.zeros(rows.shape[-1]), 0]
        if seq.pooling == "mean":
            part[0] = part[0] + rows.sum(0)
        elif seq.pooling == "last":
            part[0] = rows[-1].clone()
        elif first == 0:  # cls: the first token's
            part[0] = rows[0].clone()
        part[1] += rows.shape[0]

    def _finish(self, seq: Sequence) -> list[float]:
        vector, count = self._parts.pop(seq.seq_id)
        if seq.pooling == "mean":
            vector = vector / count
        if seq.pooling_normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def release(self, seq: Sequence) -> None:
        self._parts.pop(seq.seq_id, None)
