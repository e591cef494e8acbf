"""``PackedTensor``: a weight kept in its checkpoint's block-quantized bytes (GGUF's ggml types).

A GGUF file stores each 2-D weight as rows of fixed-size blocks (``GGML_QUANT_SIZES``: elements
and bytes per block). Dequantizing every tensor to float32 at load reads and holds several
times the bytes llama.cpp does, so a reader may hand these bytes over as they lie in the file
(``ModelSource.iter_packed``), a zero-copy view of its memory map, and a quant method that says
it takes them (``lmplug.kit.extras.PackedWeights``) multiplies by them directly. A row of the matrix is
a row of bytes, so row subsets (shards, llama.cpp's Q/K row permutation) stay packed.

The bytes are the file's own, read-only mapping: never write into ``data``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as _gguf_dequantize

# ggml type -> (elements per block, bytes per block), from gguf-py (llama.cpp's own table)
BLOCK_SIZES: dict[int, tuple[int, int]] = {int(t): size for t, size in GGML_QUANT_SIZES.items()}


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one packed row of ``cols`` elements. Raises ``ValueError`` when ``cols`` is not
    a whole number of blocks or the type is unknown."""
    if int(ggml_type) not in BLOCK_SIZES:
        raise ValueError(f"has unknown ggml type {ggml_type}")
    block, size = BLOCK_SIZES[int(ggml_type)]
    if cols % block:
        raise ValueError(f"has {cols} columns, not a whole number of {block}-element blocks of "
                         f"type {type_name(ggml_type)}")
    return cols // block * size


def type_name(ggml_type: int) -> str:
    """``Q4_K`` for a known ggml type, else the number."""
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return str(ggml_type)


@dataclass(frozen=True)
class PackedTensor:
    """A ``[rows, cols]`` weight (PyTorch order: rows are output features) as packed blocks.

    ``data``: uint8 ``[rows, row_bytes(ggml_type, cols)]``; ``name``: the checkpoint's own name
    for the tensor (e.g. ``blk.0.attn_q.weight``), for messages."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]
    name: str = ""

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def check(self) -> None:
        """Raise ``ValueError`` (a sentence the loader prefixes with the file and tensor name)
        unless ``data`` holds exactly the blocks ``shape`` and ``ggml_type`` call for."""
        rows, cols = self.shape
        expected = (rows, row_bytes(self.ggml_type, cols))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"holds {self.data.numel()} bytes as {self.data.dtype} "
                             f"{tuple(self.data.shape)}, but shape {self.shape} of type "
                             f"{self.type_name} needs uint8 {expected} ({expected[0] * expected[1]} bytes)")

    def rows(self, index: slice | torch.Tensor) -> PackedTensor:
        """Rows ``index`` (a slice: a view; a tensor of row numbers: a packed copy, e.g. a row
        permutation) as a new ``PackedTensor``."""
        data = self.data[index] if isinstance(index, slice) else self.data.index_select(0, index)
        return PackedTensor(data, self.ggml_type, (data.shape[0], self.shape[1]), self.name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float ``[rows, cols]`` matrix (gguf-py's numpy dequantize: llama.cpp's formulas)."""
        self.check()
        raw = self.data.cpu().numpy()
        if self.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            # a copy: the bytes may be the file's read-only mapping
            values = raw.view(np.float32 if self.ggml_type == GGMLQuantizationType.F32 else np.float16)
            values = values.astype(np.float32, copy=True)
        else:
            values = _gguf_dequantize(raw, GGMLQuantizationType(self.ggml_type))
            values = values.astype(np.float32, copy=False)
        out = torch.from_numpy(values).reshape(self.shape)
        return out.to(device=self.data.device, dtype=dtype)
