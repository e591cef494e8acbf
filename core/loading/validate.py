"""Structural checks of checkpoint files, against their published formats, before any tensor is read.

safetensors: 8-byte little-endian header length, a JSON object header, ``data_offsets`` relative
to the byte after the header. GGUF (ggml's gguf.md): tensor offsets relative to the data
section, which starts at the first ``general.alignment`` boundary (default 32) after the tensor
infos. All arithmetic is in Python ints, so a hostile 2**64-1 cannot wrap around.
Each check raises ``ValueError`` (bad types too) naming the tensor and key; the readers prefix the
file and raise ``ModelLoadError``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

# bits per element of every safetensors dtype (safetensors' Dtype enum)
SAFETENSORS_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_DIMS = 8


def check_safetensors_header(header: Any, data_size: int) -> list[str]:
    """The tensor names of a parsed safetensors header; ``data_size``: bytes after the header."""
    if not isinstance(header, dict):
        raise ValueError(f"the header must be a JSON object, got a {type(header).__name__}")  # noqa: TRY004
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("'__metadata__' must be an object of strings")
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = _safetensors_entry(name, entry)
        spans.append((begin, end, name))
    if spans:
        end, name = max((end, name) for _, end, name in spans)
        if end > data_size:
            raise ValueError(f"truncated: tensor {name!r} ends at byte {end} of the data section, "
                             f"which has {data_size}")
    _check_no_overlap(spans)
    return [name for name in header if name != "__metadata__"]


def _safetensors_entry(name: str, entry: Any) -> tuple[int, int]:
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r}: entry must be an object, got a {type(entry).__name__}")  # noqa: TRY004
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_BITS:
        raise ValueError(f"tensor {name!r}: 'dtype' {dtype!r} is not a safetensors dtype")
    if not _int_list(shape) or len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"tensor {name!r}: 'shape' must be a list of at most {MAX_DIMS} "
                         f"non-negative integers, got {_short(shape)}")
    if not _int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise ValueError(f"tensor {name!r}: 'data_offsets' must be [begin, end] with "
                         f"0 <= begin <= end, got {_short(offsets)}")
    bits = math.prod(shape) * SAFETENSORS_BITS[dtype]
    if (bits + 7) // 8 != offsets[1] - offsets[0]:
        raise ValueError(f"tensor {name!r}: 'data_offsets' span {offsets[1] - offsets[0]} bytes, "
                         f"but shape {shape} of {dtype} needs {(bits + 7) // 8}")
    return offsets[0], offsets[1]


def check_gguf_tensors(tensors: Iterable[tuple[str, int, list[int], int]], data_start: int,
                       file_size: int, alignment: int) -> None:
    """``tensors``: (name, ggml type, dims, offset in the data section) as the file states them."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    spans = []
    for name, raw_type, dims, offset in tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r}: unknown ggml type {raw_type}") from None
        elements = math.prod(dims)
        if not dims or elements % block or (dims[0] % block):
            raise ValueError(f"tensor {name!r}: shape {dims} is not a whole number of "
                             f"{block}-element blocks of type {GGMLQuantizationType(raw_type).name}")
        if offset % alignment:
            raise ValueError(f"tensor {name!r}: offset {offset} is not a multiple of the "
                             f"alignment {alignment}")
        begin = data_start + offset
        end = begin + elements // block * type_size
        if end > file_size:
            raise ValueError(f"truncated: tensor {name!r} needs bytes up to {end}, file has {file_size}")
        spans.append((begin, end, name))
    _check_no_overlap(spans)


def _check_no_overlap(spans: list[tuple[int, int, str]]) -> None:
    spans.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"tensors {first!r} and {second!r} overlap in the file")


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
