"""``torch_distributed``'s wire format for one KV block: a fixed int64 header, then raw bytes.

The header (``HEADER_LEN`` int64: ``BLOCK``, ``BYE``, ``SYNC`` or ``ACK``, the 128-bit key as two halves, the tensor
count, then per tensor its name as 8 ASCII bytes, a dtype code, the number of dimensions and up
to ``MAX_DIMS`` sizes; ``SYNC`` and ``ACK`` carry a sequence number in place of the key: the
producer's flush asks, the consumer answers once every block before it is stored) and the bit-exact conversion of tensors to bytes and back. Pure functions
of tensors and bytes, with no socket or secret in them, so the format reads on its own.
"""

from __future__ import annotations

import torch

from lmplug.api import KVBlockFormat

BYE, BLOCK, SYNC, ACK = 0, 1, 2, 3  # header[0]
MAX_TENSORS, MAX_DIMS = 4, 8
_PER_TENSOR = 3 + MAX_DIMS  # name, dtype code, ndim, sizes
HEADER_LEN = 4 + MAX_TENSORS * _PER_TENSOR
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.float64, torch.bool)
_MASK64 = (1 << 64) - 1


def describe(fmt: KVBlockFormat) -> dict[str, str]:
    return {"model": fmt.model, "layout": fmt.layout, "digest": fmt.digest}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _name_code(name: str) -> int:
    raw = name.encode("ascii")
    if len(raw) > 8:
        raise ValueError(f"tensor name {name!r} is longer than 8 ASCII characters")
    return _signed(int.from_bytes(raw.ljust(8, b"\0"), "little"))


def header_bye() -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = BYE
    return header


def header_sync(kind: int, seq: int) -> torch.Tensor:
    """A ``SYNC`` (producer to consumer) or its ``ACK`` (back), numbered ``seq``."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = kind, seq
    return header


def header_block(key: int, payload: dict[str, torch.Tensor]) -> torch.Tensor:
    if len(payload) > MAX_TENSORS:
        raise ValueError(f"{len(payload)} tensors, more than {MAX_TENSORS}")
    fields = [BLOCK, _signed(key & _MASK64), _signed((key >> 64) & _MASK64), len(payload)]
    for name, t in payload.items():
        if t.dtype not in DTYPES or t.dim() > MAX_DIMS:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} / {t.dim()} dimensions cannot be sent")
        fields += [_name_code(name), DTYPES.index(t.dtype), t.dim(), *t.shape]
        fields += [0] * (MAX_DIMS - t.dim())
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def parse_header(header: torch.Tensor) -> tuple[int, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    values = header.tolist()
    key = (values[1] & _MASK64) | ((values[2] & _MASK64) << 64)
    specs = []
    for i in range(values[3]):
        name_code, dtype_code, ndim, *dims = values[4 + i * _PER_TENSOR:4 + (i + 1) * _PER_TENSOR]
        name = (name_code & _MASK64).to_bytes(8, "little").rstrip(b"\0").decode("ascii")
        specs.append((name, DTYPES[dtype_code], tuple(dims[:ndim])))
    return key, specs


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when it is contiguous on the CPU)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def typed(part: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A slice of the received bytes as the tensor it was (copied when its offset in the buffer
    is not a multiple of the dtype's size, which ``view`` needs)."""
    if part.storage_offset() % torch.empty((), dtype=dtype).element_size():
        part = part.clone()
    return part.view(dtype).reshape(shape)


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
