"""The disk tier's block file: its bytes, written and checked (``disk.py`` has the layout).

``magic | version | header length | BLAKE2b-128 | JSON header | raw tensor bytes``: ``encode``
makes one block's file, ``decode`` gives its tensors back only when magic, version, model and
layout strings, key, byte lengths and checksum all match (``BadBlockFile`` says what did not).
Pure functions of bytes and tensors, with no file or thread in them, so the format reads on its own.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from lmplug.api import KVBlockFormat

MAGIC = b"LMPKVB\r\n"  # the CR/LF pair catches a copy that rewrote line endings
VERSION = 1
_PREFIX = struct.Struct("<8sII16s")  # magic, version, header length, checksum

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int32, torch.int64)}


class BadBlockFile(Exception):
    """A block file that is not what it must be (the message says why)."""


def encode(fmt: KVBlockFormat, key: int, payload: dict[str, torch.Tensor]) -> bytes:
    """One block file's bytes."""
    tensors, chunks = [], []
    for name, t in payload.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, not one of {sorted(DTYPES)}")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        tensors.append({"name": name, "dtype": dtype, "shape": list(t.shape), "nbytes": len(raw)})
        chunks.append(raw)
    header = json.dumps({"model": fmt.model, "layout": fmt.layout, "key": f"{key:032x}",
                         "tensors": tensors}).encode()
    data = b"".join(chunks)
    digest = hashlib.blake2b(header + data, digest_size=16).digest()
    return _PREFIX.pack(MAGIC, VERSION, len(header), digest) + header + data


def decode(blob: bytes, fmt: KVBlockFormat, key: int) -> dict[str, torch.Tensor]:
    """The payload in a block file's bytes; ``BadBlockFile`` when anything does not match."""
    if len(blob) < _PREFIX.size:
        raise BadBlockFile(f"truncated: {len(blob)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_len, digest = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise BadBlockFile(f"not a block file (magic {magic!r})")
    if version != VERSION:
        raise BadBlockFile(f"format version {version}, this reader knows {VERSION}")
    body = blob[_PREFIX.size:]
    if header_len > len(body):
        raise BadBlockFile(f"truncated: a header of {header_len} bytes, {len(body)} bytes follow the prefix")
    try:
        header = json.loads(body[:header_len])
        specs = [(t["name"], t["dtype"], [int(n) for n in t["shape"]], int(t["nbytes"]))
                 for t in header["tensors"]]
        model, layout, stored_key = str(header["model"]), str(header["layout"]), str(header["key"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadBlockFile(f"damaged header ({type(exc).__name__}: {exc})") from None
    data = body[header_len:]
    if sum(s[3] for s in specs) != len(data):
        raise BadBlockFile(f"truncated or damaged: the header lists {sum(s[3] for s in specs)} bytes of "
                           f"tensors, the file holds {len(data)}")
    if hashlib.blake2b(body, digest_size=16).digest() != digest:
        raise BadBlockFile("checksum mismatch (damaged)")
    if model != fmt.model:
        raise BadBlockFile(f"written for another model ({model!r}; this one is {fmt.model!r})")
    if layout != fmt.layout:
        raise BadBlockFile(f"written for another layout ({layout!r}; this one is {fmt.layout!r})")
    if stored_key != f"{key:032x}":
        raise BadBlockFile(f"holds block {stored_key}, not {key:032x}")
    return _tensors(data, specs)


def _tensors(data: bytes, specs: list[tuple[str, str, list[int], int]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, dtype_name, shape, nbytes in specs:
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise BadBlockFile(f"tensor {name!r} has unknown dtype {dtype_name!r}")
        if nbytes != torch.Size(shape).numel() * dtype.itemsize:
            raise BadBlockFile(f"tensor {name!r}: {nbytes} bytes do not make {dtype_name}{shape}")
        raw = (torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8) if nbytes
               else torch.empty(0, dtype=torch.uint8))
        out[name] = raw.view(dtype).reshape(shape)
        offset += nbytes
    return out
