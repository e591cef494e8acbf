"""The GGUF block types the native CPU kernels run (``gguf_native``) and the checks every
product of them makes: one place for the modules that bind, describe and keep the weights."""

from __future__ import annotations

import os

import torch

from lmplug.kit.threads import compute_threads

# ggml type -> (elements, bytes) of one block
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 11: (256, 110), 12: (256, 144),
          13: (256, 176), 14: (256, 210), 20: (32, 18), 23: (256, 136)}
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
         20: "IQ4_NL", 23: "IQ4_XS"}
SUPPORTED = frozenset(BLOCKS)
ERRORS = {-1: "the kernel could not allocate its scratch memory", -2: "unknown ggml type",
          -3: "k is not a multiple of the block size", -4: "instruction set not available on this CPU"}
WHAT = "gguf native mul_mat"


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one weight row of ``k`` elements; ValueError for an unsupported type or k."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"{WHAT}: ggml_type {ggml_type} is not supported; supported: "
                         f"{', '.join(f'{t} ({NAMES[t]})' for t in sorted(BLOCKS))}")
    elems, size = BLOCKS[ggml_type]
    if k <= 0 or k % elems:
        raise ValueError(f"{WHAT}: k={k} must be a positive multiple of {NAMES[ggml_type]}'s block of {elems}")
    return k // elems * size


def check_weight(w: torch.Tensor, ggml_type: int, k: int, size: int) -> tuple[int, ...]:
    """``w``'s strides, once it is checked to be packed rows of ``size`` bytes; ValueError otherwise."""
    ws, wst = w.shape, w.stride()
    if (len(ws) != 2 or w.dtype != torch.uint8 or not w.is_cpu or ws[1] != size
            or (ws[0] > 1 and wst[0] < size) or (size > 1 and wst[1] != 1)):
        raise ValueError(f"{WHAT}: w must be a uint8 CPU tensor [N, {size}] ({k} {NAMES[ggml_type]} "
                         f"values a row) with contiguous rows, got {w.dtype} {tuple(ws)} strides "
                         f"{wst} on {w.device}")
    return wst


def env_threads() -> int:
    """``LMPLUG_GGUF_THREADS``, else ``compute_threads()``; ValueError naming a bad value."""
    value = os.environ.get("LMPLUG_GGUF_THREADS")
    if not value:
        return compute_threads()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{WHAT}: LMPLUG_GGUF_THREADS={value!r} must be a positive integer")
    return int(value)
