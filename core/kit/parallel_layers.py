"""Tensor-parallel layers: column- and row-parallel ``Linear``, vocab-parallel embedding.

Column-parallel: each rank holds a slice of the output features of every fused shard
(q/k/v, gate/up) and its output stays split (the next layer reads its own heads or
intermediate slice). Row-parallel: each rank holds a slice of the input features (o, down);
the partial products are summed with one all-reduce. The vocabulary is split in rows
(padded to a multiple of N): the embedding looks up the rank's ids and all-reduces; the LM
head's logits are gathered on rank 0. On one process the factories return plain ``Linear``.

They live with the models (they subclass ``models.layers.Linear``); the loader finds which
slice of a checkpoint tensor each reads through the shard records of ``lmplug.kit.sharding``
(``ColumnShard``, ``RowShard``, ``VocabShard``), so ``lmplug.parallel`` never imports the models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmplug.interfaces.quant import QuantMethod
from lmplug.kit.layers import Linear
from lmplug.kit.parallel import ParallelState
from lmplug.kit.sharding import ColumnShard, RowShard, VocabShard


class ColumnParallelLinear(Linear, ColumnShard):
    """``shards`` maps a checkpoint name to ``(start, size)``: this rank's output features of
    that checkpoint tensor (``size`` is the local shard's size)."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int]], *, bias: bool,
                 dtype: torch.dtype, quant: QuantMethod, tp: ParallelState) -> None:
        super().__init__(in_features, {name: size for name, (_, size) in shards.items()},
                         bias=bias, dtype=dtype, quant=quant)
        self.tp_starts = {name: start for name, (start, _) in shards.items()}
        self.tp = tp


class RowParallelLinear(Linear, RowShard):
    """Input features ``[input_start, input_start + in_features)`` of the checkpoint; the output
    is all-reduced. The bias is loaded on rank 0 only (the others hold zeros), so it is added once."""

    def __init__(self, full_in_features: int, shards: dict[str, int], *, bias: bool, dtype: torch.dtype,
                 quant: QuantMethod, tp: ParallelState) -> None:
        start, size = tp.split(full_in_features)
        super().__init__(size, shards, bias=bias, dtype=dtype, quant=quant, input_start=start,
                         full_in_features=full_in_features)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.apply(self, x)
        lora = self.__dict__["lora"]
        if lora is not None:  # this rank's partial LoRA update, summed by the same all-reduce
            y = lora.add(y, x)
        return self.tp.all_reduce(y)


class VocabParallelEmbedding(torch.nn.Module, VocabShard):
    """Rows ``[vocab_start, vocab_start + local)`` of the (padded) embedding table."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: ParallelState) -> None:
        super().__init__()
        self.vocab_start, local = tp.vocab_range(vocab_size)
        self.weight = torch.nn.Parameter(torch.zeros(local, hidden, dtype=dtype), requires_grad=False)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.tp.all_reduce(x)


def column_linear(in_features: int, shards: dict[str, tuple[int, int]], *, bias: bool, dtype: torch.dtype,
                  quant: QuantMethod, tp: ParallelState) -> Linear:
    """A column-parallel layer, or a plain ``Linear`` (sizes only) on one process."""
    if not tp.is_parallel:
        return Linear(in_features, {n: size for n, (_, size) in shards.items()}, bias=bias, dtype=dtype,
                      quant=quant)
    return ColumnParallelLinear(in_features, shards, bias=bias, dtype=dtype, quant=quant, tp=tp)


def row_linear(full_in_features: int, shards: dict[str, int], *, bias: bool, dtype: torch.dtype,
               quant: QuantMethod, tp: ParallelState) -> Linear:
    """A row-parallel layer, or a plain ``Linear`` on one process."""
    if not tp.is_parallel:
        return Linear(full_in_features, shards, bias=bias, dtype=dtype, quant=quant)
    return RowParallelLinear(full_in_features, shards, bias=bias, dtype=dtype, quant=quant, tp=tp)


def embedding(vocab_size: int, hidden: int, dtype: torch.dtype, tp: ParallelState) -> torch.nn.Module:
    if not tp.is_parallel:
        emb = torch.nn.Embedding(vocab_size, hidden, dtype=dtype)
        emb.weight.requires_grad_(False)
        return emb
    return VocabParallelEmbedding(vocab_size, hidden, dtype, tp)
