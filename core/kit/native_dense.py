"""The native decode step's product for the core's own plain float32 weights (``Unquantized``).

The native decode step needs every linear layer's product as a C function (``lmplug.kit.native``);
quant methods hand theirs in (GGUF's kernels), but the core's default method for a float32
checkpoint is not a plugin and has none: its ``apply`` is torch's BLAS. This is its C form,
``dense_product_f32`` in ``csrc/fused_cpu_ops.c``, over the ``W^T`` layout ``Unquantized`` keeps
on the CPU. It runs on one thread, so the step takes it only where the engine's products run on one
thread (``compute_threads() == 1``, e.g. ``OMP_NUM_THREADS=1``); with more, torch's threaded BLAS
and the Python layers stay. The weight it reads is moved into huge pages (``lmplug.kit.hugemem``,
same values and strides; torch's BLAS reads the same copy): a float32 decode step streams 4 bytes a
weight, bound by the memory (``benchmarks/bench_hugemem.py --cases dense``).
"""

from __future__ import annotations

import ctypes

import torch

from lmplug.interfaces.quant import Unquantized
from lmplug.kit import fused_cpu, hugemem
from lmplug.kit.native import NativeCall
from lmplug.kit.threads import compute_threads


class _Dense(ctypes.Structure):
    _fields_ = [("wt", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("in_features", ctypes.c_int64),
                ("out_features", ctypes.c_int64)]


def product(linear: torch.nn.Module) -> NativeCall | None:
    """``linear``'s product as a ``PRODUCT_ABI`` call, or None: another quant method, weights that
    are not float32 ``W^T`` on the CPU, more than one compute thread, no fused library."""
    if type(linear.quant) is not Unquantized or compute_threads() != 1:
        return None
    weight, bias = linear._parameters.get("weight"), linear._parameters.get("bias")
    if (weight is None or weight.dim() != 2 or weight.dtype != torch.float32 or not weight.is_cpu
            or weight.stride() != (1, weight.shape[0])):
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_cpu or not bias.is_contiguous()):
        return None
    lib = fused_cpu.library()
    if lib is None:
        return None
    _to_huge_pages(weight)
    return _call(lib, weight, bias, "quant none (the core's C product)")


def stacked(weights: list[torch.Tensor], biases: list[torch.Tensor | None], name: str) -> NativeCall | None:
    """The product of the rows of ``weights`` ([out_i, in] each, e.g. separate q/k/v ``nn.Linear``
    weights of modules that are not the core's linear layers: an EAGLE head's) stacked, over one
    ``W^T`` copy in huge pages (``biases``: each one's or None), or None: not float32 on the CPU,
    more than one compute thread, no fused library. Each weight's values move into the copy (its
    ``.data`` becomes a view of its rows: same values, ``W^T`` strides, which torch's matmul reads
    as they are), so no second copy stays."""
    if compute_threads() != 1 or any(w.dtype != torch.float32 or not w.is_cpu or w.dim() != 2 for w in weights):
        return None
    lib = fused_cpu.library()
    if lib is None:
        return None
    weight = torch.cat([w.detach() for w in weights])  # [out, in]
    copy = hugemem.empty(weight.numel() * weight.element_size()).view(weight.dtype)
    wt = copy.view(weight.shape[1], weight.shape[0]).copy_(weight.t()).t()  # [out, in] in W^T strides
    start = 0
    for w in weights:
        w.data = wt[start:start + w.shape[0]]
        start += w.shape[0]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([torch.zeros(w.shape[0]) if b is None else b.detach().float().cpu()
                          for w, b in zip(weights, biases)]).contiguous()
    return _call(lib, wt, bias, name)


def _call(lib, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> NativeCall:
    """``dense_product_f32`` over ``weight`` [out, in] in ``W^T`` strides (kept alive by the call)."""
    desc = _Dense(weight.data_ptr(), None if bias is None else bias.data_ptr(), weight.shape[1], weight.shape[0])
    fn = ctypes.cast(lib.dense_product_f32, ctypes.c_void_p).value
    return NativeCall(fn, ctypes.addressof(desc), (desc, weight, bias, lib), name)


def _to_huge_pages(weight: torch.nn.Parameter) -> None:
    """``weight``'s values moved into huge-page memory (once; the old storage is freed with it)."""
    if getattr(weight, "lmplug_huge_pages", False) or not hugemem.enabled():
        return
    data = weight.data
    moved = hugemem.empty(data.numel() * data.element_size()).view(data.dtype)
    moved = moved.as_strided(data.shape, data.stride())
    moved.copy_(data)
    weight.data = moved
    weight.lmplug_huge_pages = True
