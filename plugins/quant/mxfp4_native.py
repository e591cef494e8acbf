"""The native CPU kernel of MXFP4 weights (``csrc/mxfp4_cpu.c``): ``linear`` (x @ W^T + bias with W
packed) and ``dequantize``, checked against ``mxfp4_ref``.

Built on first use by ``lmplug.kit.native_build`` (``$CC``, cached in ``<cache_dir>/kernels/``)
without ``-march``: the AVX2 and AVX-512 kernels carry a target attribute and are chosen at run
time, bounded by /proc/cpuinfo's flags as the GGUF kernels are (``native_build.bounded_isa``).
``LMPLUG_MXFP4_ISA`` = ``auto`` (default) | ``generic`` | ``avx2`` | ``avx512`` picks the set (the
AVX-512 one gives the portable kernel's bits); ``available()`` says whether the library builds
here and why not (a caller then keeps the PyTorch reference).

Threads: the output rows are split over the GGUF kernels' thread pool (``gguf_native``: the
same workers, never a second pool), as many as ``lmplug.kit.threads.compute_threads()`` (the
GGUF kernels' rule: fewer for a small product); one where the GGUF library does not build.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
from lmplug_quant import gguf_native, mxfp4_ref

from lmplug.kit import native_build
from lmplug.kit.native_build import NativeBuildError
from lmplug.kit.paths import cache_dir
from lmplug.kit.threads import compute_threads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "mxfp4_cpu.c"
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
ISAS = ("generic", "avx2", "avx512")  # index = the C file's isa number
ISA_FLAGS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f",)}  # what each set needs, as /proc/cpuinfo names it
_ERRORS = {-1: "the kernel could not allocate its scratch memory", -3: "k is not a multiple of 32",
           -4: "instruction set not available on this CPU"}
_WHAT = "mxfp4 native linear"


class MXFP4Kernel:
    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._linear = lib.mxfp4_linear
        self._linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p]
        self._linear.restype = ctypes.c_int
        self._dequantize = lib.mxfp4_dequantize
        self._dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int]
        self._dequantize.restype = ctypes.c_int
        self.best_isa = native_build.bounded_isa(ISAS[lib.mxfp4_cpu_isa()], ISAS, ISA_FLAGS)
        self._pool = _pool()

    def isa(self, want: str | None = None) -> int:
        """The kernel set ``want`` (default ``LMPLUG_MXFP4_ISA``, ``auto``: the best this CPU runs)."""
        want = want or os.environ.get("LMPLUG_MXFP4_ISA", "auto") or "auto"
        if want == "auto":
            return ISAS.index(self.best_isa)
        if want not in ISAS or ISAS.index(want) > ISAS.index(self.best_isa):
            raise ValueError(f"{_WHAT}: LMPLUG_MXFP4_ISA={want!r} must be auto or one of "
                             f"{', '.join(ISAS[:ISAS.index(self.best_isa) + 1])} on this CPU")
        return ISAS.index(want)

    def threads_used(self, m: int, k: int, n: int, threads: int | None = None) -> int:
        """The threads a product of this shape runs on: ``threads`` (default ``compute_threads()``),
        fewer for a small one (the GGUF pool's rule); 1 without the pool."""
        if self._pool is None:
            return 1
        return self._pool.threads_used(m, k, n, threads or compute_threads())

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
               isa: str | None = None, threads: int | None = None) -> torch.Tensor:
        """x [M, K] (float, converted to contiguous float32) @ W[N, K]^T + bias -> float32 [M, N],
        the rows split over ``threads_used(threads)`` threads."""
        n, k = _check(blocks, scales)
        if x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
            raise ValueError(f"{_WHAT}: x must be a CPU tensor [M, {k}], got {tuple(x.shape)} on {x.device}")
        x = x.to(torch.float32).contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        if out.numel() == 0:
            return out
        used = self.threads_used(x.shape[0], k, n, threads)
        status = self._linear(x.data_ptr(), x.shape[0], k, blocks.data_ptr(), scales.data_ptr(), n,
                              None if bias is None else bias.data_ptr(), out.data_ptr(), self.isa(isa), used,
                              self._pool.parallel_for if used > 1 else None)
        if status != 0:
            raise RuntimeError(f"{_WHAT}: {_ERRORS.get(status, f'error {status}')}")
        return out

    def dequantize(self, blocks: torch.Tensor, scales: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        """blocks [N, G, 16], scales [N, G] -> float32 [N, G * 32]."""
        n, k = _check(blocks, scales)
        out = torch.empty(n, k, dtype=torch.float32)
        status = self._dequantize(blocks.data_ptr(), scales.data_ptr(), n, k // 32, out.data_ptr(), self.isa(isa))
        if status != 0:
            raise RuntimeError(f"{_WHAT}: {_ERRORS.get(status, f'error {status}')}")
        return out


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    mxfp4_ref.check(blocks, scales)
    if blocks.dim() != 3 or not blocks.is_cpu or not blocks.is_contiguous() or not scales.is_contiguous():
        raise ValueError(f"{_WHAT}: blocks must be contiguous CPU [N, G, 16] with scales [N, G], got "
                         f"{tuple(blocks.shape)} on {blocks.device}")
    return blocks.shape[0], blocks.shape[1] * mxfp4_ref.BLOCK


def _pool():
    """The GGUF kernels' library, whose thread pool runs this kernel's rows; None where it does
    not build (one thread then)."""
    try:
        return gguf_native.load()
    except NativeBuildError as exc:
        logger.info("quant mxfp4: the GGUF kernels' thread pool is not available, one thread: %s", exc)
        return None


@functools.cache
def _library(cc: tuple[str, ...], root: str) -> MXFP4Kernel:
    lib, path = native_build.shared_library(SOURCE, FLAGS, cc, Path(root))
    return MXFP4Kernel(lib, path)


def load() -> MXFP4Kernel:
    """The kernel, built on first use; raises NativeBuildError with the reason."""
    return _library(native_build.compiler(), str(cache_dir()))


def available() -> tuple[MXFP4Kernel | None, str]:
    """(the kernel, "") where it builds and loads here, else (None, why), logged once."""
    try:
        return load(), ""
    except NativeBuildError as exc:
        logger.warning("quant mxfp4: the native CPU kernel is not available, using the PyTorch reference: %s", exc)
        return None, str(exc)
