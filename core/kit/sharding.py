"""Which slice of a checkpoint tensor a tensor-parallel rank reads.

The loader (``loading/weights.py``) asks ``rank_piece`` for every tensor it copies. The
tensor may be lazy (safetensors ``get_slice``: only the slice is read from disk) or a whole
tensor (GGUF, dequantized at read). Where a (possibly packed) tensor keeps its output axis
is the quant method's ``shard_layout``; its input axis, for row-parallel layers, its
``input_layout``. MoE experts (``ExpertWeights``) are split by their intermediate size, each
rank holding a slice of every expert (the block all-reduces its routed output); under expert
parallelism a rank holds whole experts and reads them whole (the model skips the other ranks'
experts by name, before anything is read; ``LazyPiece`` lets it cut a transformers-5 stacked
``[E, ...]`` tensor into experts without reading it). The loader then checks the slice's shape
like any other tensor.

A layer or module whose rank part of a tensor is several pieces of it (Mamba2's fused in_proj:
the rank's columns of each of its z, x, B, C and dt sections; a conv weight over [x | B | C]
channels; a norm over all heads) declares them in a ``RangeShard`` record: ``(start, size)``
ranges of the output axis, read one by one and concatenated.

The layers that hold a slice (``lmplug.kit.parallel_layers``) declare it by subclassing one of
the shard records below; ``lmplug.parallel`` never imports the models.
"""

from __future__ import annotations

import torch


class ColumnShard:
    """A layer holding this rank's output features of each checkpoint shard: ``tp_starts``
    (shard -> first output feature), ``shards`` (shard -> local size), ``quant``, ``tp``."""

    tp_starts: dict[str, int]


class RowShard:
    """A layer holding input features ``[input_start, input_start + in_features)`` (bias on
    rank 0 only): ``input_start``, ``in_features``, ``quant``, ``tp``."""

    input_start: int


Ranges = tuple[tuple[int, int], ...]


class RangeShard:
    """A module holding, of some checkpoint tensors, the concatenation of several ``(start, size)``
    ranges of their output axis: ``tp_ranges`` maps a ``Linear`` shard name (output axis and packing
    from its quant method's ``shard_layout``, the bias alike) or a plain parameter's name (rows,
    unpacked) to the ranges. A tensor not named there is read whole."""

    tp_ranges: dict[str, Ranges]


class VocabShard:
    """An embedding holding rows ``[vocab_start, vocab_start + weight.shape[0])``."""

    vocab_start: int


def rank_piece(model: torch.nn.Module, path: str, owner: torch.nn.Module | None, param_name: str,
               shard: str | None, tensor) -> torch.Tensor:
    """This rank's part of checkpoint ``tensor`` for parameter ``path`` (shard ``shard``).
    Raises ``ValueError`` (the loader names file and tensor) when it does not split."""
    if isinstance(owner, RangeShard):
        ranges = owner.tp_ranges.get(param_name if shard is None else shard)
        if ranges is not None:
            layout = (0, 1) if shard is None else owner.quant.shard_layout(owner, param_name)
            if layout is None:
                return _read(tensor)
            axis, pack = layout
            return torch.cat([_narrow(tensor, axis, start, size, pack, "output") for start, size in ranges],
                             dim=axis)
    if isinstance(owner, ColumnShard) and shard is not None:
        layout = owner.quant.shard_layout(owner, param_name)
        if layout is None:
            return _read(tensor)
        axis, pack = layout
        return _narrow(tensor, axis, owner.tp_starts[shard], owner.shards[shard], pack, "output")
    if isinstance(owner, RowShard):
        if param_name == "bias":  # added once, after the all-reduce: rank 0 holds it
            whole = _read(tensor)
            return whole if owner.tp.rank == 0 else torch.zeros_like(whole)
        layout = owner.quant.input_layout(owner, param_name)
        if layout is None:
            return _read(tensor)
        axis, pack = layout
        return _narrow(tensor, axis, owner.input_start, owner.in_features, pack, "input")
    if getattr(owner, "moe_expert", False):
        if model.tp.expert_parallel:  # a whole expert of this rank
            return _read(tensor)
        raise ValueError("is a quantized MoE expert, which tensor parallelism does not split by width yet; "
                         "use `parallel.expert_parallel: true` (whole experts per rank) or "
                         "tensor_parallel_size 1 for this checkpoint")
    if param_name in ("w_gate_up", "w_down") and hasattr(owner, "experts_args"):
        if model.tp.expert_parallel:  # whole experts: the rank's own, chosen by name
            return _read(tensor)
        # MoE experts (``ExpertWeights``): gate/up [I, h] split by rows, down [h, I] by columns
        start = model.tp.rank * owner.intermediate
        return _narrow(tensor, 0 if param_name == "w_gate_up" else 1, start, owner.intermediate, 1, "expert")
    vocab = _vocab_owner(model, path, owner)
    if vocab is not None:
        start, rows = vocab
        total = _shape(tensor)[0]
        piece = _read(tensor, 0, min(start, total), min(start + rows, total))
        if piece.shape[0] < rows:  # the padding rows past the vocabulary (never looked up or sampled)
            pad = torch.zeros((rows - piece.shape[0], *piece.shape[1:]), dtype=piece.dtype)
            piece = torch.cat([piece, pad])
        return piece
    return _read(tensor)


def _vocab_owner(model, path: str, owner) -> tuple[int, int] | None:
    if isinstance(owner, VocabShard):
        return owner.vocab_start, owner.weight.shape[0]
    if path == "lm_head" and getattr(model, "lm_head", None) is not None and model.tp.is_parallel:
        return model.tp.vocab_range(model.config.vocab_size)
    return None


def _narrow(tensor, axis: int, start: int, size: int, pack: int, what: str) -> torch.Tensor:
    if start % pack or size % pack:
        raise ValueError(f"covers {what} features [{start}, {start + size}) on this tensor-parallel rank, "
                         f"which do not split into whole packed elements of {pack} features")
    return _read(tensor, axis, start // pack, (start + size) // pack)


def tensor_shape(tensor) -> tuple[int, ...]:
    """The shape of a tensor, a lazy safetensors slice or a ``LazyPiece``."""
    return tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)


_shape = tensor_shape


class LazyPiece:
    """``stacked[expert, rows]`` of a lazy safetensors slice ``stacked [E, R, C]``, read only when
    indexed (``piece[a:b, c:d]`` reads ``stacked[expert, rows][a:b, c:d]`` and nothing more), so a
    rank that needs one expert, or a slice of it, reads just that."""

    def __init__(self, stacked, expert: int, rows: slice) -> None:
        self.stacked, self.expert, self.rows = stacked, expert, rows
        self.shape = (rows.stop - rows.start, *tensor_shape(stacked)[2:])

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index = (*index, *[slice(None)] * (len(self.shape) - len(index)))
        if not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            raise TypeError(f"LazyPiece takes plain slices only, got {index}")
        first, stop, _ = index[0].indices(self.shape[0])
        rows = slice(self.rows.start + first, self.rows.start + max(stop, first))
        return self.stacked[(slice(self.expert, self.expert + 1), rows, *index[1:])][0]


def _read(tensor, axis: int = 0, start: int | None = None, end: int | None = None) -> torch.Tensor:
    """``tensor[..., start:end, ...]`` along ``axis``; a lazy safetensors slice reads only that."""
    ndim = len(_shape(tensor))
    if ndim == 0:
        return tensor[()] if not isinstance(tensor, torch.Tensor) else tensor
    index = [slice(None)] * ndim
    index[axis] = slice(start, end)
    return tensor[tuple(index)]
