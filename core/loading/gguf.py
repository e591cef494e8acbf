"""Read a llama.cpp GGUF file into a :class:`ModelSource`.

A GGUF carries no ``config.json``: its metadata is the config, under llama.cpp's
key names, and its tensors use llama.cpp names, reversed dims and quantized
blocks. The architecture that reads the file's ``general.architecture`` is chosen
first (``choose``: the engine's choice, by default the highest-priority installed
one declaring it); it translates the metadata and the names
(``Architecture.gguf_config`` / ``gguf_tensor_name``), says whether Q/K rows
were permuted and undoes what else the converter changed (``gguf_values``); this
module undoes the dims, the permutation and the blocks, so nothing downstream
knows the weights came from a GGUF.

Two ways to read the tensors: ``iter_tensors`` dequantizes every one to float32 (gguf-py's
numpy dequantize), ``iter_packed`` leaves 2-D weights and quantized 3-D experts in their blocks
(``PackedTensor``, a zero-copy view of the memory map; Q/K rows un-permuted as packed rows; an
``[E, rows, cols]`` tensor as ``E * rows`` rows, which only a model whose ``split_tensor`` takes
packed tensors (``PACKED_SPLIT``) is handed) for a quant method that
multiplies by them (the ``gguf`` method, which ``quantization_config`` names for a file whose
linear weights are quantized).
"""

from __future__ import annotations

import struct
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from lmplug.errors import ModelLoadError
from lmplug.interfaces.architecture import Architecture
from lmplug.interfaces.checkpoint import ModelSource
from lmplug.interfaces.gguf_header import GGUFHeader
from lmplug.interfaces.packed import PackedTensor, row_bytes
from lmplug.kit.file_pages import release_file_pages
from lmplug.loading.tokenizer import Tokenizer
from lmplug.loading.validate import check_gguf_tensors
from lmplug.plugins import Registry, get_registry

Q = GGMLQuantizationType
# the types gguf-py's numpy dequantize implements (llama.cpp's formulas) that llama.cpp's
# quantizers write for weights
DEQUANTIZABLE = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
})
_FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
_MAX_VECTOR = 1 << 16  # GGUFHeader.vectors: settings, never a weight's worth of values
# (GGUF architecture, file) -> the architecture that reads it (``Architecture.gguf_architectures``)
ChooseReader = Callable[[str, str], type[Architecture]]


class _FastReader(GGUFReader):
    """GGUFReader with a faster metadata parse; same fields, same tensors.

    Upstream slices ``np.memmap`` several times per vocabulary string, each slice
    paying for memmap's ``__array_finalize__``: opening a 49k-token GGUF takes
    ~4.5 s. We slice a plain ndarray view of the same mapping (equally lazy) and
    walk arrays in one loop, which brings that to ~0.3 s.
    """

    def _plain_buffer(self) -> np.ndarray:
        buf = self.__dict__.get("_plain")
        if buf is None:
            buf = self._plain = self.data.view(np.ndarray)
        return buf

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None):
        buf = self._plain_buffer()
        dt = np.dtype(dtype)
        end = offset + dt.itemsize * int(count)
        if end > len(buf):  # upstream silently returns a short array
            raise ValueError(f"needs bytes up to offset {end}, but the file has {len(buf)}")
        arr = buf[offset:end].view(dt)
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type, offs = GGUFValueType(int(raw_itype[0])), orig_offs + 12
        types = [GGUFValueType.ARRAY] + ([item_type] if count[0] else [])
        parts: list[np.ndarray] = [raw_itype, count]
        if item_type == GGUFValueType.STRING:
            buf = self._plain_buffer()
            for _ in range(int(count[0])):
                (length,) = struct.unpack_from("<Q", buf, offs)
                parts.append(self._get(offs + 8, np.uint8, length))
                offs += 8 + length
            return offs - orig_offs, parts, list(range(2, len(parts))), types
        if item_type in self.gguf_scalar_to_np:
            # One part for the whole array: ReaderField.contents() flattens parts anyway.
            values = self._get(offs, self.gguf_scalar_to_np[item_type], count[0])
            return 12 + values.nbytes, parts + [values], [2], types
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        # Check every tensor's place in the file (Python ints: upstream adds a uint64 offset to
        # the data start, which wraps around) before upstream builds views at those places.
        infos = []
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            infos.append((bytes(name).decode("utf-8", "replace"), int(raw_type[0]),
                          [int(d) for d in dims.tolist()], int(offset[0])))
        try:
            check_gguf_tensors(infos, int(start_offs), len(self.data), int(self.alignment))
        except ValueError as exc:
            raise GGUFLayoutError(str(exc)) from None
        super()._build_tensors(start_offs, fields)


class GGUFLayoutError(ValueError):
    """A tensor whose offset, size or type does not fit the file (the reader adds the path)."""


def load_gguf(path: str | Path, choose: ChooseReader | None = None) -> ModelSource:
    """Open a GGUF file as a ModelSource; tensors are read and dequantized lazily. ``choose``:
    which architecture reads the file's ``general.architecture`` (default: ``gguf_reader``)."""
    path = Path(path)
    where = str(path)
    reader = _open_reader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: GGUF metadata lacks 'general.architecture' (got {arch!r})")
    reads = (choose or gguf_reader)(arch, where)
    _check_tensor_types(path, reader)
    # None: a tensor that holds settings the config translation reads (not a weight)
    named = [(t, hf) for t in reader.tensors for hf in [reads.gguf_tensor_name(t.name, where)] if hf is not None]
    hf_config = reads.gguf_config(_header(where, arch, metadata, reader))
    head_counts = {
        "attn_q": hf_config["num_attention_heads"],
        "attn_k": hf_config["num_key_value_heads"],
    } if arch in reads.gguf_permuted else {}

    def iter_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor, hf_name in named:
            yield hf_name, reads.gguf_values(tensor.name, _load_tensor(tensor, head_counts))

    def iter_packed() -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
        file_bytes = _file_bytes(reader)
        for tensor, hf_name in named:
            if len(tensor.shape) == 2 or (len(tensor.shape) == 3 and tensor.tensor_type not in _FLOAT_TYPES):
                yield hf_name, _packed_tensor(file_bytes, tensor, head_counts)
            else:
                yield hf_name, reads.gguf_values(tensor.name, _load_tensor(tensor, {}))

    return ModelSource(
        path=path,
        format="gguf",
        hf_config=hf_config,
        tensor_names=[hf_name for _, hf_name in named],
        iter_tensors=iter_tensors,
        iter_packed=iter_packed,
        tokenizer=Tokenizer.from_gguf(metadata, name=path.name),
        generation_config=_generation_config(hf_config),
    )


def gguf_reader(arch: str, where: str, registry: Registry | None = None) -> type[Architecture]:
    """The installed architecture that reads GGUF architecture ``arch``: the highest priority
    among those declaring it (then distribution and name, as ``auto`` ranks them)."""
    table = (registry or get_registry()).backends("model").values()
    readers = sorted((i for i in table if arch in i.cls.gguf_architectures),
                     key=lambda i: (-i.cls.capabilities.priority, i.distribution, i.name))
    if not readers:
        known = sorted({a for i in table for a in i.cls.gguf_architectures})
        raise ModelLoadError(f"{where}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(known) or 'none'} (the GGUF architectures the installed "
                             "architectures read: `lmplug plugins`)")
    return readers[0].cls


def _header(where: str, arch: str, metadata: dict[str, Any], reader: GGUFReader) -> GGUFHeader:
    # MXFP4 experts (GPT-OSS: 3-D) count too: the gguf method keeps them packed
    quantized = any(t.name.startswith("blk.") and t.tensor_type not in _FLOAT_TYPES
                    and (len(t.shape) == 2 or t.tensor_type == Q.MXFP4) for t in reader.tensors)
    tensors = {t.name: tuple(int(d) for d in t.shape.tolist()) for t in reader.tensors}
    # settings stored as small float tensors (LongRoPE factors), read for the config translation
    vectors = {t.name: tuple(float(v) for v in _load_tensor(t, {}).tolist()) for t in reader.tensors
               if len(t.shape) == 1 and not t.name.startswith(("blk.", "output_norm."))
               and t.tensor_type in _FLOAT_TYPES and int(t.n_elements) <= _MAX_VECTOR}
    return GGUFHeader(where, arch, metadata, tensors, quantized, vectors)


def _open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (expected magic b'GGUF', found {magic!r})")
    try:
        return _FastReader(path)
    except GGUFLayoutError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except Exception as e:  # the reader raises bare ValueError/IndexError on damage
        raise ModelLoadError(f"{path}: cannot read GGUF header (truncated or corrupt?): {e}") from e


def _check_tensor_types(path: Path, reader: GGUFReader) -> None:
    # Fail at load time, not halfway through building the model.
    for t in reader.tensors:
        if t.tensor_type not in DEQUANTIZABLE:
            allowed = ", ".join(sorted(q.name for q in DEQUANTIZABLE))
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, "
                f"which lmplug cannot dequantize; supported: {allowed}"
            )


def _load_tensor(tensor: Any, head_counts: dict[str, int]) -> torch.Tensor:
    values = dequantize(tensor.data, tensor.tensor_type)  # numpy dims == PyTorch order
    if values.dtype != np.float32:
        values = values.astype(np.float32)
    elif not values.flags.writeable:  # F32 is a view of the read-only mapping
        values = values.copy()
    # GGUF stores 1-D tensors as-is and N-D with reversed dims, which dequantize
    # already reports reversed; only the element count can disagree for odd shapes.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weights = torch.from_numpy(values).reshape(shape)
    kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if kind in head_counts:
        weights = unpermute_rows(weights, head_counts[kind])
    return weights


def _file_bytes(reader: GGUFReader) -> torch.Tensor:
    """The whole file as one uint8 tensor over the reader's (read-only) memory map: packed
    tensors are views of it, so fused shards that lie back to back stay one view."""
    with warnings.catch_warnings():  # torch warns that the mapping is read-only; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(reader.data.view(np.ndarray))


def _packed_tensor(file_bytes: torch.Tensor, tensor: Any, head_counts: dict[str, int]) -> PackedTensor:
    """A 2-D tensor's blocks as they lie in the file (GGUF dims are reversed: ne0 = columns); a
    3-D ``[E, rows, cols]`` one (MoE experts) as its ``E * rows`` rows, expert after expert."""
    cols, *rest = (int(d) for d in tensor.shape.tolist())
    rows = int(np.prod(rest))
    start, width = int(tensor.data_offset), row_bytes(int(tensor.tensor_type), cols)
    data = file_bytes[start:start + rows * width].view(rows, width)
    packed = PackedTensor(data, int(tensor.tensor_type), (rows, cols), tensor.name)
    kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if kind in head_counts:  # llama.cpp's q/k row order undone: a copy, the file's pages given back
        packed = packed.rows(unpermute_index(rows, head_counts[kind]))
        release_file_pages(data)
    return packed


def unpermute_index(rows: int, n_heads: int) -> torch.Tensor:
    """The row order ``unpermute_rows`` produces: HF row ``i`` is GGUF row ``index[i]`` (a row
    permutation, so packed rows are reordered as they are)."""
    return unpermute_rows(torch.arange(rows), n_heads)


def unpermute_rows(weights: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> HF rotate-half).

    llama.cpp's converter views each head's rows as [2, d/2] and transposes to
    [d/2, 2]; so we view them as [d/2, 2] and transpose back. Biases permute alike.
    """
    rows = weights.shape[0]
    half = rows // n_heads // 2
    w = weights.reshape(n_heads, half, 2, *weights.shape[1:])
    return w.transpose(1, 2).reshape(weights.shape).contiguous()


def _generation_config(hf_config: dict) -> dict:
    return {
        k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config
    }
