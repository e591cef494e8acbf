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
``LMPLUG_GGUF_ISA`` = ``auto`` (default) | ``generic`` (the portable C kernels) | ``avx2`` |
``avx512`` (AVX-512 F/BW/VL + VNNI over weights repacked at bind into 16-row panels, see
``csrc/gguf_repack.c``, in huge pages by ``lmplug.kit.hugemem``; rows that lie in the file's memory map are then dropped from the
process's memory, ``release_file_pages``, so the panels are not a second resident copy); on
aarch64 ``generic`` | ``neon`` | ``dotprod`` (NEON with SDOT). Results do not depend on the
thread count; the AVX-512 and NEON kernels give the portable kernels' bits, the AVX2 ones differ
from them only in the order of float additions.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import platform
import sys
import weakref
from pathlib import Path

import torch

from lmplug.kit import hugemem, native_build
from lmplug.kit.native import NativeCall
from lmplug.kit.native_build import NativeBuildError
from lmplug.kit.paths import cache_dir
from lmplug.kit.threads import compute_threads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "gguf_cpu.c"
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")  # no fused a*b+c the C does not write
# ggml type -> (elements, bytes) of one block
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 11: (256, 110), 12: (256, 144),
          13: (256, 176), 14: (256, 210)}
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
SUPPORTED = frozenset(BLOCKS)


def kernel_sets(machine: str) -> tuple[str, ...]:
    """The kernel sets of a build for ``machine`` (``platform.machine()``), by the C file's isa number."""
    return ("generic", "neon", "dotprod") if machine.lower() in ("aarch64", "arm64") else ("generic", "avx2", "avx512")


ISAS = kernel_sets(platform.machine())
PANEL_TYPES = frozenset({2, 3, 6, 7, 8, 11, 12, 13, 14})  # the types with an AVX-512 panel kernel
PACKED_FLAG = 0x100  # csrc/gguf_cpu.c: a type | this = weights in 16-row panels
# what each kernel set needs, as /proc/cpuinfo names it (the missing ones are logged)
ISA_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
             "neon": ("asimd",), "dotprod": ("asimd", "asimddp")}  # aarch64: its "Features" line
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
_ERRORS = {-1: "the kernel could not allocate its scratch memory", -2: "unknown ggml type",
           -3: "k is not a multiple of the block size", -4: "instruction set not available on this CPU"}
_WHAT = "gguf native mul_mat"
_warned: set[str] = set()
_loaded: dict[tuple[str | None, ...], GGUFKernel] = {}
_panels: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # GGUFKernel.panels, by weight


def cpuinfo_isa(cpuid_best: str, isas: tuple[str, ...] | None = None,
                isa_flags: dict[str, tuple[str, ...]] | None = None) -> str:
    """``native_build.bounded_isa`` over this kernel's sets (read at call time: ``ISAS`` is the
    machine's, and tests patch it), or another kernel's (the MXFP4 kernel's)."""
    return native_build.bounded_isa(cpuid_best, ISAS if isas is None else isas,
                                    ISA_FLAGS if isa_flags is None else isa_flags)


def describe_isa(best: str) -> str:
    """The kernel set ``auto`` picks, what it leaves out (the features a faster set needs that
    this CPU lacks) and the types that take another path: the load's log line."""
    missing = native_build.missing_flags(ISA_FLAGS)
    text = {"generic": "portable C (no SIMD kernel set runs here)", "avx2": "AVX2 (+FMA, F16C)",
            "avx512": "AVX-512 F/BW/VL + VNNI over 16-row panels repacked at load", "neon": "NEON",
            "dotprod": "NEON + dotprod (SDOT)"}[best]
    better = [name for name in ISAS[ISAS.index(best) + 1:]]
    if better:
        text += "; " + ", ".join(f"{name} needs {' '.join(missing[name])}" for name in better if missing[name])
    others = sorted(set(SUPPORTED) - PANEL_TYPES) if best == "avx512" else []
    if others:
        text += "; " + ", ".join(NAMES[t] for t in others) + " take the AVX2 kernel"
    return text


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one weight row of ``k`` elements; ValueError for an unsupported type or k."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"{_WHAT}: ggml_type {ggml_type} is not supported; supported: "
                         f"{', '.join(f'{t} ({NAMES[t]})' for t in sorted(BLOCKS))}")
    elems, size = BLOCKS[ggml_type]
    if k <= 0 or k % elems:
        raise ValueError(f"{_WHAT}: k={k} must be a positive multiple of {NAMES[ggml_type]}'s block of {elems}")
    return k // elems * size


class GGUFKernel:
    """The loaded library: ``mul_mat`` one product."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._fn = lib.gguf_mul_mat
        self._fn.argtypes, self._fn.restype = _ARGTYPES, ctypes.c_int
        self.best_isa = cpuinfo_isa(ISAS[lib.gguf_cpu_isa()])
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
        logger.info("quant gguf: native CPU kernels: %s", describe_isa(self.best_isa))

    def panels(self, w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        """``w``'s rows repacked into the AVX-512 kernels' 16-row panels (uint8, 1-D), made
        once per weight (a layer's bound product and its native-step product share them)."""
        stride = _check_weight(w, ggml_type, k, row_bytes(ggml_type, k))[0]
        key = (w.data_ptr(), stride, w.shape[0], ggml_type, k)
        found = _panels.get(key)
        if found is not None:
            return found
        out = hugemem.empty(self._packed_bytes(ggml_type, w.shape[0], k))
        status = self._repack(ggml_type, w.data_ptr(), stride, w.shape[0], k, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"{_WHAT}: repacking: {_ERRORS.get(status, f'error {status}')}")
        out.lmplug_source = w  # the rows stay alive while their panels are cached: no address reuse
        _panels[key] = out
        out.lmplug_rows_in_file = release_file_pages(w)
        return out

    def panels_only(self, w: torch.Tensor, ggml_type: int, k: int) -> bool:
        """Where ``w``'s panels exist and ``w`` is memory of this process's own (a copy made at
        load: llama's permuted q/k joined with v) rather than the file's mapping: the panels and
        their cache forget ``w``, so it is freed once its holder drops it, and the panels are the
        one copy of those weights (``rows`` rebuilds them). True when so; False leaves ``w`` as it is
        (rows in the file's mapping: their pages were released when the panels were made)."""
        stride = _check_weight(w, ggml_type, k, row_bytes(ggml_type, k))[0]
        key = (w.data_ptr(), stride, w.shape[0], ggml_type, k)
        found = _panels.get(key)
        if found is None or found.lmplug_rows_in_file:
            return False
        del _panels[key], found.lmplug_source
        return True

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

    def operand(self, w: torch.Tensor, ggml_type: int, k: int, isa: int) -> tuple[torch.Tensor, int]:
        """(weights, type) as a bound product hands them to the C: the panels and the type
        flagged packed where the AVX-512 set runs this type, else ``w`` as it is."""
        if ISAS[isa] == "avx512" and ggml_type in PANEL_TYPES:
            return self.panels(w, ggml_type, k), ggml_type | PACKED_FLAG
        return w, ggml_type

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
        wst = _check_weight(w, ggml_type, k, row_bytes(ggml_type, k))
        self.isa = kernel.isa()
        self.k, self.n, self.stride = k, w.shape[0], wst[0]
        self.w, self.ggml_type = kernel.operand(w, ggml_type, k, self.isa)
        self.threads = _threads() if os.environ.get("LMPLUG_GGUF_THREADS") else None
        self._fn = kernel._fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: a contiguous float32 CPU tensor [M, k] (the caller's check) -> float32 [M, N]."""
        m = x.shape[0]
        if x.shape[1] != self.k:
            raise ValueError(f"{_WHAT}: x must be [M, k={self.k}], got {tuple(x.shape)}")
        out = torch.empty(m, self.n, dtype=torch.float32)
        if m == 0 or self.n == 0:
            return out
        threads = self.threads or compute_threads()
        status = self._fn(x.data_ptr(), m, self.k, self.w.data_ptr(), self.stride, self.n, self.ggml_type,
                          out.data_ptr(), threads, self.isa)
        if status != 0:
            raise RuntimeError(f"{_WHAT}: {_ERRORS.get(status, f'error {status}')}")
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
        raise ValueError(f"{_WHAT}: a layer of {len(runs)} runs; at most {MAX_RUNS}")
    desc = _Layer(k=k, isa=kernel.isa(), n_runs=len(runs),
                  threads=_threads() if os.environ.get("LMPLUG_GGUF_THREADS") else 0)
    total, keep = 0, []  # keep: the panels the C reads
    for i, (kind, w) in enumerate(runs):
        if isinstance(w, BoundProduct):
            if w.k != k or w.isa != desc.isa:
                raise ValueError(f"{_WHAT}: a bound run of k={w.k}, kernel set {ISAS[w.isa]}; the layer has k={k}, "
                                 f"kernel set {ISAS[desc.isa]}")
            keep.append(w.w)
            desc.runs[i] = _Run(w.w.data_ptr(), w.stride, w.n, w.ggml_type)
            total += w.n
            continue
        if kind == "t":
            if w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] != k or w.stride(1) != 1 or not w.is_cpu:
                raise ValueError(f"{_WHAT}: a transposed dense run must be float32 CPU rows [{k}, n], got "
                                 f"{w.dtype} {tuple(w.shape)} strides {w.stride()}")
            desc.runs[i] = _Run(w.data_ptr(), w.stride(0) * 4, w.shape[1], DENSE_T)
            total += w.shape[1]
            continue
        if kind in FLOAT_TYPES:  # packed rows of unquantized values
            size = k * FLOAT_TYPES[kind]
            if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != size or w.stride(1) != 1 or not w.is_cpu:
                raise ValueError(f"{_WHAT}: a type-{kind} run must be uint8 CPU rows [n, {size}], got {w.dtype} "
                                 f"{tuple(w.shape)} strides {w.stride()}")
            desc.runs[i] = _Run(w.data_ptr(), w.stride(0), w.shape[0], kind)
        elif kind is None:
            if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1 or not w.is_cpu:
                raise ValueError(f"{_WHAT}: a dense run must be float32 CPU rows [n, {k}], got {w.dtype} "
                                 f"{tuple(w.shape)} strides {w.stride()}")
            desc.runs[i] = _Run(w.data_ptr(), w.stride(0) * 4, w.shape[0], DENSE)
        else:
            stride = _check_weight(w, kind, k, row_bytes(kind, k))[0]
            data, flagged = kernel.operand(w, kind, k, desc.isa)
            keep.append(data)
            desc.runs[i] = _Run(data.data_ptr(), stride, w.shape[0], flagged)
        total += w.shape[0]
    desc.n = total
    if bias is not None:
        if bias.dtype != torch.float32 or bias.shape != (total,) or not bias.is_contiguous() or not bias.is_cpu:
            raise ValueError(f"{_WHAT}: the bias must be a contiguous float32 CPU tensor ({total},), got "
                             f"{bias.dtype} {tuple(bias.shape)}")
        desc.bias = bias.data_ptr()
    fn = ctypes.cast(kernel.layer_fn, ctypes.c_void_p).value
    return NativeCall(fn, ctypes.addressof(desc), (desc, kernel, [w for _, w in runs], keep, bias), name,
                      {**_ERRORS, -5: "the layer's description is out of range"}, kernel.parallel_for)


MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def release_file_pages(w: torch.Tensor) -> bool:
    """Drop this process's pages of ``w``'s rows when they lie in a read-only file mapping (the
    GGUF's memory map), once its panels are made: the resident memory then holds the panels,
    not a second copy of the weights. The rows stay valid: a later read (an embedding lookup of
    the tied head, the op path) faults its pages back in from the file. Memory of any other kind
    (a copy made at load: permuted q/k rows, joined shards) is left alone. True when released."""
    if not sys.platform.startswith("linux") or w.numel() == 0:
        return False
    page = mmap.PAGESIZE
    start = w.data_ptr()
    end = start + (w.shape[0] - 1) * w.stride(0) + w.shape[1]
    lo, hi = -(-start // page) * page, end // page * page  # the whole pages inside the rows
    if hi <= lo:
        return False
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                first, last = (int(a, 16) for a in fields[0].split("-"))
                if first <= lo < last:
                    if hi > last or fields[1][1] != "-" or fields[4] == "0" or len(fields) < 6:
                        return False  # writable, anonymous, or not one mapping: keep it
                    return _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0
    except OSError:
        return False
    return False


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc


def _check_weight(w: torch.Tensor, ggml_type: int, k: int, size: int) -> tuple[int, ...]:
    """``w``'s strides, once it is checked to be packed rows of ``size`` bytes; ValueError otherwise."""
    ws, wst = w.shape, w.stride()
    if (len(ws) != 2 or w.dtype != torch.uint8 or not w.is_cpu or ws[1] != size
            or (ws[0] > 1 and wst[0] < size) or (size > 1 and wst[1] != 1)):
        raise ValueError(f"{_WHAT}: w must be a uint8 CPU tensor [N, {size}] ({k} {NAMES[ggml_type]} "
                         f"values a row) with contiguous rows, got {w.dtype} {tuple(ws)} strides "
                         f"{wst} on {w.device}")
    return wst


def _threads() -> int:
    value = os.environ.get("LMPLUG_GGUF_THREADS")
    if not value:
        return compute_threads()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{_WHAT}: LMPLUG_GGUF_THREADS={value!r} must be a positive integer")
    return int(value)


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
