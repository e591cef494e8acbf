"""Native CPU products of float activations with packed GGUF weights (``csrc/gguf_cpu.c``).

``mul_mat(x, w, ggml_type, k)``, also registered as the torch op
``torch.ops.lmplug_quant.gguf_mul_mat(Tensor x, Tensor w, int ggml_type, int k) -> Tensor``:
x float32 [M, k] (other float dtypes and strides are converted), w uint8 [N, row_bytes], the
weight's rows of ggml blocks as stored in the file (a view into an mmap is fine; each row must
be contiguous), returns float32 [M, N] = x @ dequantize(w)^T, computed with x quantized per
block to 8 bits and integer dot products (the C file's header has the math). Types: ``SUPPORTED``.

The library is built on first use by ``lmplug.kit.native_build`` (``$CC``, cached in
``<cache_dir>/kernels/``) without ``-march``: the AVX2 kernels (on aarch64 the NEON + dotprod
ones, ``csrc/gguf_neon.c``) are compiled with target attributes and chosen at run time from
what the CPU reports, so a cached build runs on any x86-64 or aarch64 (the cache key still
holds the CPU's flags, as for every native kernel).
``available()`` says whether it builds here, and why not (logged once); a caller then keeps
its PyTorch path.

Environment: ``LMPLUG_GGUF_THREADS`` (default ``lmplug.kit.threads.compute_threads()``:
torch's thread count, also inside a step whose small ops the engine keeps on one thread) and
``LMPLUG_GGUF_ISA`` = ``auto`` (default) | ``generic`` (the portable C kernels) | ``avx2`` (the
AVX-VNNI set's panel kernels with ``vpdpbusd`` as ``vpmaddubsw`` + ``vpmaddwd``) | ``avxvnni`` (256-bit ``vpdpbusd`` over the
AVX-512 set's panels, ``csrc/gguf_vnni256.c``: VEX on CPUs with AVX-VNNI, the EVEX form where
AVX-512 VL + VNNI stand in for it) | ``avx512`` (AVX-512 F/BW/VL + VNNI over weights repacked at
bind into 16-row panels, see ``csrc/gguf_repack.c``); on aarch64 ``generic`` | ``neon`` |
``dotprod`` (NEON with SDOT). ``GGUFKernel.panel_types`` says which types each set reads in
panels (the library's ``gguf_cpu_panels``). The SIMD sets read their weights in huge pages
(``gguf_weights``: the panels, or the rows copied at bind; rows that lie in the file's memory map
are then dropped from the process's memory, ``release_file_pages``, so the copy is not a second
resident one). Results do not depend on the thread count, nor on the kernel set: every SIMD
kernel gives the portable kernels' bits (on aarch64 the types without a NEON kernel, Q5_0, Q5_1,
Q3_K, IQ4_NL and IQ4_XS, run the portable ones).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

import torch
from lmplug_quant import gguf_weights
from lmplug_quant.gguf_blocks import BLOCKS, NAMES, SUPPORTED, row_bytes
from lmplug_quant.gguf_blocks import ERRORS as _ERRORS
from lmplug_quant.gguf_blocks import WHAT as _WHAT
from lmplug_quant.gguf_blocks import check_weight as _check_weight
from lmplug_quant.gguf_blocks import env_threads as _threads
from lmplug_quant.gguf_layer import FLOAT_TYPES, MAX_RUNS, BoundProduct, _Layer, layer_product
from lmplug_quant.gguf_weights import release_file_pages

from lmplug.kit import hugemem, native_build
from lmplug.kit.native_build import NativeBuildError
from lmplug.kit.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "gguf_cpu.c"
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")  # no fused a*b+c the C does not write
# what callers and tests import from here, defined beside it (gguf_blocks, gguf_layer, gguf_weights)
__all__ = ["BLOCKS", "FLOAT_TYPES", "MAX_RUNS", "NAMES", "SUPPORTED", "BoundProduct", "_Layer", "layer_product",
           "release_file_pages", "row_bytes"]


def kernel_sets(machine: str) -> tuple[str, ...]:
    """The kernel sets of a build for ``machine`` (``platform.machine()``), by the C file's isa number."""
    if machine.lower() in ("aarch64", "arm64"):
        return ("generic", "neon", "dotprod")
    return ("generic", "avx2", "avxvnni", "avx512")


ISAS = kernel_sets(platform.machine())
PACKED_FLAG = 0x100  # csrc/gguf_cpu.c: a type | this = weights in 16-row panels
# what each kernel set needs, as /proc/cpuinfo names it (the missing ones are logged; "a|b": either)
ISA_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avxvnni": ("avx2", "fma", "f16c", "avx_vnni|avx512_vnni"),
             "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
             "neon": ("asimd",), "dotprod": ("asimd", "asimddp")}  # aarch64: its "Features" line
VNNI_ENCODINGS = (None, "VEX", "EVEX")  # by gguf_cpu_vnni_encoding(): which twin the avxvnni set runs
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
_warned: set[str] = set()
_loaded: dict[tuple[str | None, ...], GGUFKernel] = {}


def cpuinfo_isa(cpuid_best: str, isas: tuple[str, ...] | None = None,
                isa_flags: dict[str, tuple[str, ...]] | None = None) -> str:
    """``native_build.bounded_isa`` over this kernel's sets (read at call time: ``ISAS`` is the
    machine's, and tests patch it), or another kernel's (the MXFP4 kernel's)."""
    return native_build.bounded_isa(cpuid_best, ISAS if isas is None else isas,
                                    ISA_FLAGS if isa_flags is None else isa_flags)


def describe_isa(best: str, panels: bool = False) -> str:
    """The kernel set ``auto`` picks (``panels``: over 16-row panels, ``GGUFKernel.panel_types``)
    and what it leaves out (the features a faster set needs that this CPU lacks): the load's log
    line."""
    missing = native_build.missing_flags(ISA_FLAGS)
    text = {"generic": "portable C (no SIMD kernel set runs here)", "avx2": "AVX2 (+FMA, F16C)",
            "avxvnni": "AVX-VNNI (256-bit vpdpbusd)", "avx512": "AVX-512 F/BW/VL + VNNI", "neon": "NEON",
            "dotprod": "NEON + dotprod (SDOT)"}[best]
    if panels:
        text += " over 16-row panels repacked at load"
    lacking = [f"{name} needs {' '.join(f.replace('|', ' or ') for f in missing[name])}"
               for name in ISAS[ISAS.index(best) + 1:] if missing[name]]
    if lacking:
        text += "; " + ", ".join(lacking)
    return text


class GGUFKernel:
    """The loaded library: ``mul_mat`` one product."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._fn = lib.gguf_mul_mat
        self._fn.argtypes, self._fn.restype = _ARGTYPES, ctypes.c_int
        self.best_isa = cpuinfo_isa(ISAS[lib.gguf_cpu_isa()])
        # the avxvnni set's encoding here: "VEX" (AVX-VNNI), "EVEX" (AVX-512 VL + VNNI) or None
        self.vnni_encoding = VNNI_ENCODINGS[lib.gguf_cpu_vnni_encoding()] if "avxvnni" in ISAS else None
        # the thread pool's entry for another kernel's rows (``mxfp4_native``): its address
        self.parallel_for = ctypes.cast(lib.gguf_cpu_parallel_for, ctypes.c_void_p).value
        self._threads = lib.gguf_cpu_threads
        self._threads.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._threads.restype = ctypes.c_int
        self._pool_workers = lib.gguf_cpu_pool_workers
        self._pool_workers.argtypes, self._pool_workers.restype = [], ctypes.c_int
        self.layer_fn = lib.gguf_layer_product  # called from C (lmplug.kit.native), not here
        self._packed_bytes = lib.gguf_packed_bytes
        self._packed_bytes.argtypes, self._packed_bytes.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64], \
            ctypes.c_int64
        self._repack = lib.gguf_repack
        self._repack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p]
        self._repack.restype = ctypes.c_int
        self._unrepack = lib.gguf_unrepack
        self._unrepack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int64]
        self._unrepack.restype = ctypes.c_int
        self._dequantize = lib.gguf_dequantize_rows
        self._dequantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                                     ctypes.c_void_p]
        self._dequantize.restype = ctypes.c_int
        # per kernel set, the types it reads in 16-row panels repacked at bind (the rest: rows)
        panels = lib.gguf_cpu_panels
        panels.argtypes, panels.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        self.panel_types = {name: frozenset(t for t in SUPPORTED if panels(t, isa) == 1)
                            for isa, name in enumerate(ISAS)}
        logger.info("quant gguf: native CPU kernels: %s",
                    describe_isa(self.best_isa, bool(self.panel_types[self.best_isa])))

    def panels(self, w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        """``w``'s rows repacked into the panel sets' 16-row panels (uint8, 1-D, in huge
        pages), made once per weight (a layer's bound product and its native-step product share
        them: ``gguf_weights.cached_copy``)."""
        stride = _check_weight(w, ggml_type, k, row_bytes(ggml_type, k))[0]

        def make() -> torch.Tensor:
            out = hugemem.empty(self._packed_bytes(ggml_type, w.shape[0], k))
            status = self._repack(ggml_type, w.data_ptr(), stride, w.shape[0], k, out.data_ptr())
            if status != 0:
                raise RuntimeError(f"{_WHAT}: repacking: {_ERRORS.get(status, f'error {status}')}")
            return out
        return gguf_weights.cached_copy("panels", w, ggml_type, k, make)

    def panels_only(self, w: torch.Tensor, ggml_type: int, k: int) -> bool:
        """Where ``w``'s copy the kernels read exists (panels, or rows in huge pages) and ``w`` is
        memory of this process's own (a copy made at load: llama's permuted q/k joined with v)
        rather than the file's mapping: the copy and its cache forget ``w``, so it is freed once
        its holder drops it, and the copy is the one copy of those weights (``rows`` rebuilds
        rows from panels). True when so; False leaves ``w`` as it is (``gguf_weights.forget_source``)."""
        _check_weight(w, ggml_type, k, row_bytes(ggml_type, k))
        return gguf_weights.forget_source(w, ggml_type, k)

    def rows(self, panels: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
        """The ``n`` rows [n, row_bytes] of ``panels``: the file's bytes again (the inverse of the repack)."""
        size = row_bytes(ggml_type, k)
        if panels.numel() != self._packed_bytes(ggml_type, n, k):
            raise ValueError(f"{_WHAT}: {panels.numel()} bytes are not the panels of {n} {NAMES[ggml_type]} rows of {k}")
        out = torch.empty(n, size, dtype=torch.uint8)
        status = self._unrepack(ggml_type, panels.data_ptr(), n, k, out.data_ptr(), size)
        if status != 0:
            raise RuntimeError(f"{_WHAT}: unpacking panels: {_ERRORS.get(status, f'error {status}')}")
        return out

    def dequantize(self, w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        """``w``'s rows [n, row_bytes] as float32 [n, k], bit-identical to ``gguf_ref.dequantize``
        (``csrc/gguf_dequant.c``): a packed token table's lookup."""
        stride = _check_weight(w, ggml_type, k, row_bytes(ggml_type, k))[0]
        out = torch.empty(w.shape[0], k, dtype=torch.float32)
        status = self._dequantize(w.data_ptr(), stride, w.shape[0], ggml_type, k, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"{_WHAT}: dequantizing: {_ERRORS.get(status, f'error {status}')}")
        return out

    def operand(self, w: torch.Tensor, ggml_type: int, k: int, isa: int) -> tuple[torch.Tensor, int]:
        """(weights, type) as a bound product hands them to the C: the panels and the type
        flagged packed where the set reads this type in panels (``panel_types``); for the other SIMD sets the rows
        copied into huge pages (``gguf_weights.hot_rows``: ``w`` itself where huge pages are off;
        their row stride is the copy's); for the portable set ``w`` as it is (bound by arithmetic,
        not by the memory: huge pages gave it nothing measurable)."""
        if ggml_type in self.panel_types.get(ISAS[isa], ()):
            return self.panels(w, ggml_type, k), ggml_type | PACKED_FLAG
        if ISAS[isa] == "generic":
            return w, ggml_type
        return gguf_weights.hot_rows(w, ggml_type, k), ggml_type

    def threads_used(self, m: int, k: int, n: int, num_threads: int) -> int:
        """The threads a product of this shape runs on (fewer than asked when the work is small)."""
        return self._threads(m, k, n, num_threads)

    def pool_workers(self) -> int:
        """The worker threads the library keeps between calls (started by the first call that
        uses 2 or more threads; none in a child after fork() until it calls)."""
        return self._pool_workers()

    def isa(self) -> int:
        """The kernel set ``LMPLUG_GGUF_ISA`` asks for (``auto``: the best this CPU runs)."""
        want = os.environ.get("LMPLUG_GGUF_ISA", "auto") or "auto"
        if want == "auto":
            return ISAS.index(self.best_isa)
        if want not in ISAS:
            raise ValueError(f"{_WHAT}: LMPLUG_GGUF_ISA={want!r} must be one of auto, {', '.join(ISAS)}")
        if ISAS.index(want) > ISAS.index(self.best_isa):
            raise ValueError(f"{_WHAT}: LMPLUG_GGUF_ISA={want!r} but this CPU runs at most {self.best_isa!r}")
        return ISAS.index(want)

    def mul_mat(self, x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int,
                num_threads: int | None = None) -> torch.Tensor:
        """x [M, k] @ dequantize(w [N, row_bytes])^T -> float32 [M, N] (module docstring)."""
        size = row_bytes(ggml_type, k)
        xs, ws = x.shape, w.shape
        if len(xs) != 2 or xs[1] != k or not x.is_floating_point() or not x.is_cpu:
            raise ValueError(f"{_WHAT}: x must be a float CPU tensor [M, k={k}], got {x.dtype} "
                             f"{tuple(xs)} on {x.device}")
        wst = _check_weight(w, ggml_type, k, size)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        out = torch.empty(xs[0], ws[0], dtype=torch.float32)
        if out.numel() == 0:
            return out
        threads = num_threads if num_threads is not None else _threads()
        status = self._fn(x.data_ptr(), xs[0], k, w.data_ptr(), wst[0], ws[0], ggml_type,
                          out.data_ptr(), max(1, threads), self.isa())
        if status != 0:
            raise RuntimeError(f"{_WHAT}: {_ERRORS.get(status, f'error {status}')}")
        return out


def load() -> GGUFKernel:
    """The kernel for the current ``$CC`` and cache folder, built on first use (then cached in
    the process); raises NativeBuildError with the reason."""
    key = (os.environ.get("CC"), os.environ.get("LMPLUG_CACHE"), os.environ.get("HOME"))
    kernel = _loaded.get(key)  # a dict look-up per call: splitting $CC and the path cost ~50 us
    if kernel is None:
        kernel = _loaded[key] = _library(native_build.compiler(), str(cache_dir()))
    return kernel


def available() -> tuple[bool, str]:
    """(True, path of the library) when the kernels build and load here, else (False, why),
    logged once per reason."""
    try:
        return True, load().path
    except NativeBuildError as exc:
        why = str(exc)
    if why not in _warned:
        _warned.add(why)
        logger.warning("quant gguf: the native CPU kernels are not available, using the PyTorch path: %s", why)
    return False, why


@functools.cache
def _library(cc: tuple[str, ...], root: str) -> GGUFKernel:
    lib, path = native_build.shared_library(SOURCE, FLAGS, cc, Path(root))
    return GGUFKernel(lib, path)


def mul_mat(x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int,
            num_threads: int | None = None) -> torch.Tensor:
    """``GGUFKernel.mul_mat`` of the loaded library (NativeBuildError where it does not build)."""
    return load().mul_mat(x, w, ggml_type, k, num_threads)


# torch.library.Library + impl rather than torch.library.custom_op: the dispatch costs about
# 4 us a call instead of about 30, and decode calls it for every linear layer.
_LIB = torch.library.Library("lmplug_quant", "FRAGMENT")
_LIB.define("gguf_mul_mat(Tensor x, Tensor w, int ggml_type, int k) -> Tensor")
_LIB.impl("gguf_mul_mat", mul_mat, "CPU")


@torch.library.register_fake("lmplug_quant::gguf_mul_mat", lib=_LIB)
def _gguf_mul_mat_fake(x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    torch._check(x.dim() == 2 and w.dim() == 2, lambda: f"{_WHAT}: x and w must be 2-D")
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)
