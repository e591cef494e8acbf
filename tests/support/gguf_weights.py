"""Packed GGUF weight rows for the native kernels' tests: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 quantized by
gguf-py from random floats; the k-quants and IQ4_NL / IQ4_XS random bytes with sane fp16 scales
(every bit pattern of their quants and 6-bit scales is valid)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
import numpy as np
from gguf import GGMLQuantizationType

if TYPE_CHECKING:
    import torch

# ggml type -> (elements, bytes) of one block (ggml's layouts)
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 11: (256, 110), 12: (256, 144),
          13: (256, 176), 14: (256, 210), 20: (32, 18), 23: (256, 136)}


def type_id(name: str) -> int:
    return int(GGMLQuantizationType[name])


def fp16_fields(name: str) -> list[int]:
    """The byte offsets of a block's fp16 scales: d, and dmin where the type has one."""
    if name in ("Q6_K", "Q3_K"):  # d last
        return [BLOCKS[type_id(name)][1] - 2]
    return [0, 2] if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0]


def make_weight(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: the packed rows."""
    rng = np.random.default_rng(seed)
    t = type_id(name)
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType(t))
    elems, size = BLOCKS[t]
    w = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    scales = (rng.uniform(1e-3, 1e-2, (n, k // elems, 2)) * rng.choice([-1, 1], (n, k // elems, 2)))
    scales = scales.astype(np.float16).view(np.uint8)
    for i, at in enumerate(fp16_fields(name)):  # (IQ4_XS's bytes 2-3: its scales' high bits)
        w[..., at:at + 2] = scales[..., 2 * i:2 * i + 2]
    return w.reshape(n, -1)


def quantize_acts(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization: per block d = amax / 127, q = round-to-nearest-even
    (x * (1 / d)); float32 throughout, as the C does. Returns q [M, nb, block] (float64, exact
    integers) and d [M, nb] (float32)."""
    import torch

    xb = x.reshape(x.shape[0], -1, block)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.double(), d


def f16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes (last dim) as float16 -> float32."""
    import torch

    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def file_rows(path, w: np.ndarray):
    """``w``'s rows as a uint8 tensor viewing a read-only memory map of a file written at ``path``
    (as the GGUF reader leaves a weight), 100 bytes in: the rows do not start on a page."""
    import warnings

    import torch

    path.write_bytes(b"\0" * 100 + w.tobytes())
    with warnings.catch_warnings():  # torch: the mapping is read-only (nothing writes it)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.memmap(path, mode="r")[100:].view(np.ndarray)).view(w.shape[0], -1)


def resident_kib(lo: int, hi: int) -> int:
    """This process's resident KiB of the mapping holding addresses [lo, hi) (/proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.readlines()
    for line in lines:
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            first, last = (int(a, 16) for a in head[0].split("-"))
            found = first <= lo < last and hi <= last
        elif found and head[0] == "Rss:":
            return int(head[1])
    raise AssertionError("no mapping holds the rows")
