"""A GGUF weight's product bound once (``BoundProduct``) and a linear layer's whole product as one
native call (``layer_product``), over the kernels of ``gguf_native``: the decode hot path, where
per-call checks cost more than a small layer's product."""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch
from lmplug_quant.gguf_blocks import ERRORS, WHAT, check_weight, env_threads, row_bytes

from lmplug.kit.native import NativeCall
from lmplug.kit.threads import compute_threads

if TYPE_CHECKING:
    from lmplug_quant.gguf_native import GGUFKernel


class BoundProduct:
    """``x @ dequantize(w)^T`` for one weight, checked once: the decode hot path of a linear
    layer (``GGUFQuant.apply`` calls it for every linear layer of every step, 121 times a token
    on the demo model, where the per-call checks, the op dispatch and the environment look-ups
    of ``mul_mat`` cost more than a small layer's product). ``LMPLUG_GGUF_ISA`` and
    ``LMPLUG_GGUF_THREADS`` are read when it is bound (the model's load); the thread count
    otherwise follows ``lmplug.kit.threads.compute_threads()`` at each call (torch's
    thread count, also while the engine keeps torch's small ops on one thread)."""

    __slots__ = ("_fn", "ggml_type", "isa", "k", "n", "stride", "threads", "w")

    def __init__(self, kernel: GGUFKernel, w: torch.Tensor, ggml_type: int, k: int) -> None:
        wst = check_weight(w, ggml_type, k, row_bytes(ggml_type, k))
        self.isa = kernel.isa()
        self.k, self.n = k, w.shape[0]
        self.w, self.ggml_type = kernel.operand(w, ggml_type, k, self.isa)
        self.stride = self.w.stride(0) if self.w.dim() == 2 else wst[0]  # rows (maybe a copy), or panels
        self.threads = env_threads() if os.environ.get("LMPLUG_GGUF_THREADS") else None
        self._fn = kernel._fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: a contiguous float32 CPU tensor [M, k] (the caller's check) -> float32 [M, N]."""
        m = x.shape[0]
        if x.shape[1] != self.k:
            raise ValueError(f"{WHAT}: x must be [M, k={self.k}], got {tuple(x.shape)}")
        out = torch.empty(m, self.n, dtype=torch.float32)
        if m == 0 or self.n == 0:
            return out
        threads = self.threads or compute_threads()
        status = self._fn(x.data_ptr(), m, self.k, self.w.data_ptr(), self.stride, self.n, self.ggml_type,
                          out.data_ptr(), threads, self.isa)
        if status != 0:
            raise RuntimeError(f"{WHAT}: {ERRORS.get(status, f'error {status}')}")
        return out


class _Run(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("w_stride", ctypes.c_int64), ("n", ctypes.c_int64),
                ("type", ctypes.c_int64)]


MAX_RUNS = 8  # csrc/gguf_cpu.c
DENSE = -1  # a run of float32 rows [n, k] (a float shard of a mixed layer)
FLOAT_TYPES = {0: 4, 1: 2, 30: 2}  # F32, F16, BF16 rows a layer product reads: bytes a value
DENSE_T = -2  # a run of float32 W^T [k, n] rows (a dense layer as Unquantized keeps it on the CPU)


class _Layer(ctypes.Structure):
    _fields_ = [("k", ctypes.c_int64), ("n", ctypes.c_int64), ("isa", ctypes.c_int64), ("n_runs", ctypes.c_int64),
                ("threads", ctypes.c_int64), ("bias", ctypes.c_void_p), ("runs", _Run * MAX_RUNS)]


def layer_product(kernel: GGUFKernel, runs: list[tuple[int | str | None, torch.Tensor]], k: int,
                  bias: torch.Tensor | None, name: str = "quant gguf") -> NativeCall:
    """A linear layer's whole product (its runs side by side, then the bias) as a
    ``lmplug.kit.native`` product: ``gguf_layer_product`` with a context describing
    ``runs`` (ggml type, packed rows, ``SUPPORTED`` or ``FLOAT_TYPES``; None, float32 rows [n, k]; or ``"t"``, float32 W^T [k, n]
    with dense rows; or a ggml type and its ``BoundProduct``: the weights as bound, panels where it has them). The weights are checked
    here, once; ``LMPLUG_GGUF_ISA`` and ``LMPLUG_GGUF_THREADS`` are read now (as ``BoundProduct``
    reads them)."""
    if not 1 <= len(runs) <= MAX_RUNS:
        raise ValueError(f"{WHAT}: a layer of {len(runs)} runs; at most {MAX_RUNS}")
    desc = _Layer(k=k, isa=kernel.isa(), n_runs=len(runs),
                  threads=env_threads() if os.environ.get("LMPLUG_GGUF_THREADS") else 0)
    total, keep = 0, []  # keep: the panels the C reads
    for i, (kind, w) in enumerate(runs):
        if isinstance(w, BoundProduct):
            if w.k != k or w.isa != desc.isa:
                # the kernel sets' names, where tests patch them
                from lmplug_quant.gguf_native import ISAS
                raise ValueError(f"{WHAT}: a bound run of k={w.k}, kernel set {ISAS[w.isa]}; the layer has k={k}, "
                                 f"kernel set {ISAS[desc.isa]}")
            keep.append(w.w)
            desc.runs[i] = _Run(w.w.data_ptr(), w.stride, w.n, w.ggml_type)
            total += w.n
            continue
        if kind == "t":
            if w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] != k or w.stride(1) != 1 or not w.is_cpu:
                raise ValueError(f"{WHAT}: a transposed dense run must be float32 CPU rows [{k}, n], got "
                                 f"{w.dtype} {tuple(w.shape)} strides {w.stride()}")
            desc.runs[i] = _Run(w.data_ptr(), w.stride(0) * 4, w.shape[1], DENSE_T)
            total += w.shape[1]
            continue
        if kind in FLOAT_TYPES:  # packed rows of unquantized values
            size = k * FLOAT_TYPES[kind]
            if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != size or w.stride(1) != 1 or not w.is_cpu:
                raise ValueError(f"{WHAT}: a type-{kind} run must be uint8 CPU rows [n, {size}], got {w.dtype} "
                                 f"{tuple(w.shape)} strides {w.stride()}")
            desc.runs[i] = _Run(w.data_ptr(), w.stride(0), w.shape[0], kind)
        elif kind is None:
            if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1 or not w.is_cpu:
                raise ValueError(f"{WHAT}: a dense run must be float32 CPU rows [n, {k}], got {w.dtype} "
                                 f"{tuple(w.shape)} strides {w.stride()}")
            desc.runs[i] = _Run(w.data_ptr(), w.stride(0) * 4, w.shape[0], DENSE)
        else:
            stride = check_weight(w, kind, k, row_bytes(kind, k))[0]
            data, flagged = kernel.operand(w, kind, k, desc.isa)
            stride = data.stride(0) if data.dim() == 2 else stride  # rows (maybe a copy), or panels
            keep.append(data)
            desc.runs[i] = _Run(data.data_ptr(), stride, w.shape[0], flagged)
        total += w.shape[0]
    desc.n = total
    if bias is not None:
        if bias.dtype != torch.float32 or bias.shape != (total,) or not bias.is_contiguous() or not bias.is_cpu:
            raise ValueError(f"{WHAT}: the bias must be a contiguous float32 CPU tensor ({total},), got "
                             f"{bias.dtype} {tuple(bias.shape)}")
        desc.bias = bias.data_ptr()
    fn = ctypes.cast(kernel.layer_fn, ctypes.c_void_p).value
    return NativeCall(fn, ctypes.addressof(desc), (desc, kernel, [w for _, w in runs], keep, bias), name,
                      {**ERRORS, -5: "the layer's description is out of range"}, kernel.parallel_for)
