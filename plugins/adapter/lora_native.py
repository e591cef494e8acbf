"""The native CPU LoRA product (``csrc/lora_cpu.c``): a linear layer's native product with the
layer's adapter updates added, so that the native decode step (``lmplug.kit.native_step``) serves
LoRA engines too instead of leaving them to the Python layers.

``wrap(base, lora)`` returns a ``NativeCall`` to ``lora_product``, whose context holds the base
product, the layer's slots (``LinearLoRA.a`` and its ``NativeSlots``: each slot's dtype, float32
or the 16-bit dtype its adapter file stores, converted to float32 as the kernels load it; the
scalings; the compact B, each output row's own R columns of B, none of a fused layer's
block-diagonal zeros; filled in place, their addresses never change), the shards' output bounds and the
engine's row -> slot map (``LoRAStep.native_rows``, written before every forward). The library
is built when the native step is first planned (the first forward) by ``lmplug.kit.native_build`` (portable C, AVX2 + FMA and AVX-512F dot
products, F16C / AVX-512F half conversions, chosen at run time; ``LMPLUG_LORA_ISA`` = ``generic`` | ``avx2`` | ``avx512`` picks one
below the CPU's best, for tests and benchmarks).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from lmplug.kit import native_build
from lmplug.kit.native import NativeCall
from lmplug.kit.native_build import NativeBuildError
from lmplug.kit.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "lora_cpu.c"
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
ISAS = ("generic", "avx2", "avx512")  # index = the C file's isa number
ISA_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512f",)}  # what each set needs, as /proc/cpuinfo names it
ERRORS = {-201: "the step's row -> slot map has a different number of rows than the product",
          -202: "a row's adapter slot is past the layer's slots", -203: "instruction set not available on this CPU",
          -204: "could not allocate scratch memory", -205: "a slot's dtype is not float32, float16 or bfloat16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Ctx(ctypes.Structure):
    _fields_ = [("base", _P), ("base_ctx", _P), ("a", _P), ("a16", _P), ("b", _P), ("dtype", _P), ("scale", _P),
                ("slots", _I64), ("rank", _I64), ("shards", _I64), ("in_", _I64), ("out", _I64), ("bounds", _P),
                ("rows", _P), ("isa", ctypes.c_int), ("parallel_for", _P)]


@functools.cache
def _library(cc: tuple[str, ...], root: str) -> ctypes.CDLL:
    lib, _ = native_build.shared_library(SOURCE, FLAGS, cc, Path(root))
    lib.lora_cpu_isa.restype = ctypes.c_int
    lib.lora_add.argtypes = [_P, _P, _I64, _P, ctypes.c_int]
    lib.lora_add.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL:
    """The library for the current ``$CC`` and cache folder (NativeBuildError with the reason)."""
    return _library(native_build.compiler(), str(cache_dir()))



def isa(lib: ctypes.CDLL) -> int:
    """The kernel set to use: the best both CPUID and /proc/cpuinfo's flags allow, or
    ``LMPLUG_LORA_ISA`` (ValueError when unknown or above that)."""
    best = ISAS.index(native_build.bounded_isa(ISAS[lib.lora_cpu_isa()], ISAS, ISA_FLAGS))
    wanted = os.environ.get("LMPLUG_LORA_ISA", "").strip().lower()
    if not wanted or wanted == "auto":
        return best
    if wanted not in ISAS or ISAS.index(wanted) > best:
        raise ValueError(f"adapter: LMPLUG_LORA_ISA={wanted!r} must be auto or one of "
                         f"{', '.join(ISAS[:best + 1])} (what this CPU runs)")
    return ISAS.index(wanted)


def context(lora, base: NativeCall | None, lib: ctypes.CDLL, parallel_for: int | None = None) -> tuple[_Ctx, object] | None:
    """``lora``'s (a ``LinearLoRA``) C context around ``base`` (None: ``lora_add`` alone), and
    what must stay alive with it; None where its slots are not float32 on the CPU. The update runs
    on ``base``'s thread pool (``NativeCall.parallel_for``; without ``base``, ``parallel_for``'s),
    or on the calling thread where it has none."""
    native, a = lora.native, lora.a
    if native is None or a.dtype != torch.float32 or not a.is_cpu or not a.is_contiguous():
        return None
    bounds = torch.tensor([start for start, _ in lora.ranges] + [lora.ranges[-1][1]], dtype=torch.int64)
    rows = lora.step.native_rows
    ctx = _Ctx(base.fn if base else None, base.ctx if base else None, a.data_ptr(), native.a16.data_ptr(),
               native.b.data_ptr(), native.dtype.data_ptr(), native.scale.data_ptr(), a.shape[0], lora.max_rank,
               len(lora.ranges), lora.in_features, lora.out_features, bounds.data_ptr(), ctypes.addressof(rows),
               isa(lib), base.parallel_for if base else parallel_for)
    return ctx, (a, native, bounds, rows, base, lib)


def wrap(base: NativeCall, lora) -> NativeCall | None:
    """``base`` with ``lora``'s update added (module docstring), or None: the Python path."""
    try:
        lib = load()
    except NativeBuildError as exc:
        logger.warning("adapter: the native LoRA product does not build here, LoRA engines keep the "
                       "Python layers: %s", exc)
        return None
    made = context(lora, base, lib)
    if made is None:
        return None
    ctx, keep = made
    return NativeCall(ctypes.cast(lib.lora_product, ctypes.c_void_p).value, ctypes.addressof(ctx), keep=(ctx, keep),
                      name=f"adapter ({base.name or 'a quant method'}'s product + LoRA)", errors={**(base.errors or {}),
                                                                                            **ERRORS})
