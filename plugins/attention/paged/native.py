"""The ``paged`` backend's native CPU decode kernel: build, load and call ``csrc/paged_decode_cpu.c``.

``paged_cpu.py`` gathers every sequence's context into a padded ``[B, Hkv, S_max, D]``
tensor and runs two batched matmuls over the padding too; on a batch that mixes short
and long contexts that is several times the inherent cost, reading each sequence's K
and V once. The C kernel walks the block tables itself and does the online softmax on
the cache, per (sequence, KV head), with no copy and no padding (see its header).

The shared library is built on first use with ``$CC`` (default ``cc``) and
``FLAGS`` into ``<cache_dir>/kernels/paged_decode_cpu-<hash>.so`` by
``lmplug.kit.native_build``: the hash covers the source, the flags, the compiler's
``--version`` and the CPU's model and feature lines (``-march=native`` code from another
CPU may not run here), and the library is renamed into place whole.

``available()`` says whether the kernel builds here (and why not), ``load()`` returns
it; ``paged_decode_attention`` has the arguments and result of the decode reference
``decode_ref.decode_attention`` for float32 / bfloat16 / float16 caches (quantized
KV is refused: it keeps the reference path). The backend calls ``prepare`` once per
step and ``NativeKernel.decode`` once per layer.

Tree masks (speculative draft trees): ``mask_starts`` int32 [B] and ``masks`` int64 [B]
(the uint64 bits). A row with ``mask_starts[b] >= 0`` attends to the positions below it and,
of ``[mask_starts[b], seq_lens[b])`` (at most 64), those whose bit ``p - mask_starts[b]``
is set; ``-1`` leaves a row plain. A masked row's result is bit for bit that of a plain row
over a cache holding its attended K/V at consecutive positions (the kernel's header says why).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from lmplug_attention.paged.rows import leading_short_queries, query_rows

from lmplug.kit import native_build
from lmplug.kit.native import NativeCall
from lmplug.kit.native_build import NativeBuildError
from lmplug.kit.paths import cache_dir

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_cpu.c"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")
_SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16",
            torch.float16: "paged_decode_f16"}
# q, k_cache, v_cache, block_tables, bt_stride, seq_lens, mask_starts, masks, out, B, H, Hkv, D,
# block_size, scale, window, softcap, sinks, num_threads (csrc/paged_decode_cpu.c, DECODE_ARGS)
_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + \
    [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
MAX_MASK_SPAN = 64  # positions [mask_start, seq_len) one uint64 mask covers
_WHAT = "paged native decode"

NativeKernelUnavailable = NativeBuildError  # the C kernel cannot be built or loaded here (why)

def compiler() -> list[str]:
    """``$CC`` split into words (it may carry a launcher such as ``ccache gcc``), default ``cc``."""
    return list(native_build.compiler())

_loaded: dict[tuple[str | None, ...], NativeKernel] = {}

def load() -> NativeKernel:
    """The kernel for the current ``$CC`` and cache folder, built on first use (then cached in
    the process); raises NativeKernelUnavailable with the reason. A dict look-up once loaded
    (the native decode step asks every step): splitting ``$CC`` and resolving the cache folder
    cost tens of microseconds."""
    key = (os.environ.get("CC"), os.environ.get("LMPLUG_CACHE"), os.environ.get("HOME"))
    kernel = _loaded.get(key)
    if kernel is None:
        kernel = _loaded[key] = _library(native_build.compiler(), str(cache_dir()))
    return kernel

native_build.declare("paged_decode_cpu", load)  # built at engine load, not in the first decode


def available() -> tuple[bool, str]:
    """(True, path of the library) when the kernel builds and loads here, else (False, why)."""
    try:
        return True, load().path
    except NativeKernelUnavailable as exc:
        return False, str(exc)

def supported_dtypes() -> frozenset[torch.dtype]:
    """The storage dtypes the built library has a function for (float16 needs ``_Float16``)."""
    return load().dtypes

def library_path(cc: tuple[str, ...], root: Path) -> Path:
    """Where the build for this source, compiler, flags and CPU lives."""
    return native_build.library_path(SOURCE, FLAGS, cc, root)

@functools.cache
def _library(cc: tuple[str, ...], root: str) -> NativeKernel:
    """Build (when not cached) and load the library; raises NativeKernelUnavailable with the reason."""
    lib, path = native_build.shared_library(SOURCE, FLAGS, cc, Path(root))
    functions = {}
    for dtype, name in _SYMBOLS.items():
        if hasattr(lib, name):
            fn = functions[dtype] = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return NativeKernel(lib, functions, path)

@dataclass
class Prepared:
    """One decode batch's block tables and lengths as the kernel reads them (int32, contiguous),
    and its rows' tree masks, if any (``check_masks``)."""
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]
    mask_starts: torch.Tensor | None = None  # [B] int32, -1: no mask
    masks: torch.Tensor | None = None  # [B] int64, the uint64 bits

def prepare(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int,
            check: bool = True, mask_starts: torch.Tensor | None = None,
            masks: torch.Tensor | None = None) -> Prepared:
    """int32 contiguous copies (when needed) of a batch's tables and lengths, checked to stay in the
    cache: the kernel trusts them, and a block id out of range would read outside it. With
    ``mask_starts`` and ``masks``, the rows' tree masks, checked by ``check_masks``."""
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if tables.dim() != 2 or lens.dim() != 1 or tables.shape[0] != lens.shape[0]:
        raise ValueError(f"{_WHAT}: block_tables must be [B, max_blocks] and seq_lens [B], got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if tables.device.type != "cpu" or lens.device.type != "cpu":
        raise ValueError(f"{_WHAT}: block_tables and seq_lens must be CPU tensors, got {tables.device} "
                         f"and {lens.device}")
    if check and lens.numel():
        used = -(-lens.long() // block_size)  # blocks each sequence reads
        if int(lens.min()) < 0 or int(used.max()) > tables.shape[1]:
            raise ValueError(f"{_WHAT}: seq_lens must lie in [0, max_blocks * block_size = "
                             f"{tables.shape[1] * block_size}], got {lens.tolist()}")
        ids = tables[torch.arange(tables.shape[1]) < used.unsqueeze(1)]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"{_WHAT}: block_tables name blocks outside [0, {num_blocks})")
    return Prepared(tables, lens, *check_masks(mask_starts, masks, lens))

def check_masks(mask_starts: torch.Tensor | None, masks: torch.Tensor | None,
                seq_lens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The tree masks as the kernel reads them (contiguous int32 / int64 CPU tensors), or
    (None, None) for none: both or neither given, ``mask_starts`` int32 [B] and ``masks`` int64 [B]
    (the uint64 bits; bit 63 is the sign bit), and ``0 <= seq_lens[b] - mask_starts[b] <= 64``
    for every masked row (``mask_starts[b] >= 0``). ValueError naming the argument otherwise."""
    if mask_starts is None and masks is None:
        return None, None
    if mask_starts is None or masks is None:
        given, missing = ("mask_starts", "masks") if masks is None else ("masks", "mask_starts")
        raise ValueError(f"{_WHAT}: {given} given without {missing}: tree masks need both")
    size = seq_lens.shape[0]
    for name, t, dtype in (("mask_starts", mask_starts, torch.int32), ("masks", masks, torch.int64)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != (size,) or t.device.type != "cpu":
            got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{_WHAT}: {name} must be a {dtype} CPU tensor of shape [B] = ({size},), "
                             f"got {got}")
    masked = mask_starts >= 0
    span = seq_lens.to(torch.int64) - mask_starts.to(torch.int64)
    bad = masked & ((span < 0) | (span > MAX_MASK_SPAN))
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()[:8]
        raise ValueError(f"{_WHAT}: mask_starts must lie in [seq_lens - {MAX_MASK_SPAN}, seq_lens] for "
                         f"masked rows (one uint64 mask per row), got rows {rows}: mask_starts "
                         f"{mask_starts[rows].tolist()}, seq_lens {seq_lens[rows].tolist()}")
    return mask_starts.contiguous(), masks.contiguous()

class NativeKernel:
    """The loaded library: ``decode`` one batch (``prepare`` its tables once per step)."""

    def __init__(self, lib: ctypes.CDLL, functions: dict, path: str) -> None:
        self._functions = functions  # storage dtype -> ctypes function
        # decode_step_attention's address: the native decode step calls it from C (lmplug.kit.native)
        self.step_fn = ctypes.cast(lib.decode_step_attention, ctypes.c_void_p).value
        self.path = path
        self.dtypes = frozenset(functions)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Prepared,
               scale: float, sliding_window: int | None, out: torch.Tensor,
               num_threads: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q, out [B, H, D]; caches [num_blocks, block_size, Hkv, D]: one call of the kernel (tree
        masks: ``batch``'s, checked by ``prepare``); scores soft-capped at ``softcap``, ``sinks``
        [H] (one logit per query head) in each row's softmax denominator, where given."""
        fn = self._function(q, k_cache, v_cache, out)
        sinks = _sinks_arg(softcap, sinks, q.shape[1])
        mask_starts, masks = batch.mask_starts, batch.masks
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        size, num_heads, _ = q.shape
        if batch.block_tables.shape[0] != size:
            raise ValueError(f"{_WHAT}: {size} queries but {batch.block_tables.shape[0]} block tables")
        if size == 0:
            return out
        threads = torch.get_num_threads() if num_threads is None else num_threads
        status = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), batch.block_tables.data_ptr(),
                    batch.block_tables.stride(0), batch.seq_lens.data_ptr(),
                    None if mask_starts is None else mask_starts.data_ptr(),
                    None if masks is None else masks.data_ptr(), out.data_ptr(), size,
                    num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window or 0,
                    softcap or 0.0, None if sinks is None else sinks.data_ptr(), max(1, threads))
        if status != 0:
            raise MemoryError(f"{_WHAT}: the kernel could not allocate its scratch memory")
        return out

    def _function(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor):
        if not (q.dim() == out.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape):
            raise ValueError(f"{_WHAT}: q and out must be [B, H, D] and the caches [num_blocks, block_size, "
                             f"Hkv, D], got q {tuple(q.shape)}, out {tuple(out.shape)}, k_cache "
                             f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k_cache.shape[2]
        if out.shape != q.shape or head_dim != k_cache.shape[3] or num_heads % num_kv_heads:
            raise ValueError(f"{_WHAT}: q {tuple(q.shape)} needs head_dim {k_cache.shape[3]} and a multiple "
                             f"of {num_kv_heads} heads, and out its shape (got {tuple(out.shape)})")
        tensors = (q, k_cache, v_cache, out)
        if not all(t.dtype == q.dtype and t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            names = ("q", "k_cache", "v_cache", "out")
            got = ", ".join(f"{n} {t.dtype} {t.device} strides {t.stride()}" for n, t in zip(names, tensors))
            raise ValueError(f"{_WHAT}: q, the caches and out must be contiguous CPU tensors of one dtype "
                             f"(quantized KV takes the PyTorch path), got {got}")
        fn = self._functions.get(q.dtype)
        if fn is None:
            raise ValueError(f"{_WHAT}: no kernel for {q.dtype} here; supported: "
                             f"{sorted(str(d) for d in self.dtypes)}")
        return fn

def _sinks_arg(softcap: float | None, sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """``sinks`` as the kernel reads them (contiguous float32 CPU [H]), ``softcap`` checked."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{_WHAT}: softcap must be None or > 0, got {softcap!r}")
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or sinks.device.type != "cpu" or not sinks.is_floating_point():
        raise ValueError(f"{_WHAT}: sinks must be a float CPU tensor [num_heads={num_heads}], got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    return sinks.to(torch.float32).contiguous()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None, max_seq_len: int | None = None,
                           partition_size: int | None = None, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           num_threads: int | None = None, mask_starts: torch.Tensor | None = None,
                           masks: torch.Tensor | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_ref.decode_attention`` in C: q [B, H, D], block_tables [B, max_blocks],
    seq_lens [B] -> [B, H, D] (into ``out`` when given). ``max_seq_len`` and ``partition_size``
    are accepted for parity and not needed; ``num_threads`` defaults to ``torch.get_num_threads()``.
    ``mask_starts`` int32 [B] and ``masks`` int64 [B]: per-row tree masks (module docstring).
    ``softcap`` and ``sinks``: as the reference's.
    """
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"{_WHAT}: quantized KV caches are not supported (they take the PyTorch path)")
    if k_cache.dim() != 4:
        raise ValueError(f"{_WHAT}: k_cache must be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)}")
    kernel = load()
    batch = prepare(block_tables, seq_lens, k_cache.shape[1], k_cache.shape[0], mask_starts=mask_starts,
                    masks=masks)
    q = q.contiguous()
    if out is not None and out.is_contiguous():
        return kernel.decode(q, k_cache, v_cache, batch, scale, sliding_window, out, num_threads, softcap, sinks)
    result = kernel.decode(q, k_cache, v_cache, batch, scale, sliding_window,
                           torch.empty(q.shape, dtype=q.dtype, device=q.device), num_threads, softcap, sinks)
    return result if out is None else out.copy_(result)

class _StepAttention(ctypes.Structure):
    _fields_ = [("k_caches", ctypes.c_void_p), ("v_caches", ctypes.c_void_p), ("num_layers", ctypes.c_int64),
                ("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("rows", ctypes.c_int64), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64),
                ("D", ctypes.c_int64), ("block_size", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("window", ctypes.c_int64), ("scale", ctypes.c_float), ("q", ctypes.c_void_p),
                ("checked", ctypes.c_int64), ("mask_starts", ctypes.c_void_p), ("masks", ctypes.c_void_p),
                ("layer_scales", ctypes.c_void_p), ("layer_softcaps", ctypes.c_void_p),
                ("layer_windows", ctypes.c_void_p)]

# decode_step_attention's error codes
STEP_ERRORS = {-1: "could not allocate its scratch memory", -2: "slot_mapping names a slot outside the cache",
               -3: "a layer outside the step's caches", -4: "seq_lens outside [1, max_blocks * block_size]",
               -5: "block_tables name a block outside the cache"}
_step_caches: dict[int, tuple] = {}  # id(views) -> (key, per-layer cache pointers or None)

def _layer_pointers(views: list, num_kv_heads: int, head_dim: int) -> tuple | None:
    """(k pointers, v pointers, cache shape) of the model's cache layers, or None where some layer
    is not a contiguous float32 CPU cache of the model's heads; cached per views list (the
    model's own, bound once), checked again when its first or last layer's storage moved."""
    key = (len(views), views[0].k_cache.data_ptr(), views[-1].k_cache.data_ptr(), views[-1].v_cache.data_ptr(),
           views[0].k_cache.shape, views[0].k_cache.dtype, views[0].k_scale is None)
    hit = _step_caches.get(id(views))
    if hit is not None and hit[0] == key:
        return hit[1]
    k0, value = views[0].k_cache, None
    if all(view.k_scale is None and view.k_cache.dtype == torch.float32 and view.k_cache.is_cpu
           and view.k_cache.shape == k0.shape and view.v_cache.shape == k0.shape
           and view.k_cache.is_contiguous() and view.v_cache.is_contiguous() for view in views) \
            and k0.shape[2] == num_kv_heads and k0.shape[3] == head_dim:
        value = ((ctypes.c_void_p * len(views))(*[v.k_cache.data_ptr() for v in views]),
                 (ctypes.c_void_p * len(views))(*[v.v_cache.data_ptr() for v in views]), tuple(k0.shape))
    if len(_step_caches) > 64:  # engines come and go in one process (tests): keep it small
        _step_caches.clear()
    _step_caches[id(views)] = (key, value)
    return value

def step_attention(ctx, views: list, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   sliding_window: int | None, name: str, specs: tuple = (),
                   kernel: NativeKernel | None = None) -> NativeCall | None:
    """A step's attention as a ``lmplug.kit.native`` attention function
    (``decode_step_attention``: the KV write, then this kernel), or None where the step does not
    fit it: a query longer than ``paged_rows`` reads as rows (a prefill), caches that are not
    float32 on the CPU (quantized KV), the kernel not built here. Decodes are one row each; a
    speculative verify's short queries (chains and draft trees) one row per query token
    (``paged_rows.query_rows``), so each token gets the bits it would get decoded alone. The
    C function checks the step's tables and slots against the cache (``STEP_ERRORS``). ``specs``:
    the backend's ``LayerAttention`` per cache layer where they differ (scale, window, soft-cap;
    sinks have no native step: None). ``kernel``: the caller's, loaded once (``load()`` reads three
    environment variables, tens of microseconds a decode step once the weights have swept the
    caches); None: loaded here."""
    if not views:
        return None
    per_layer = _per_layer(specs, len(views)) if specs else None
    if specs and per_layer is None:
        return None
    decodes = ctx.num_decodes == ctx.num_seqs and not ctx.query_masks
    if not decodes and leading_short_queries(ctx, trees=True) < ctx.num_seqs:
        return None
    layers = _layer_pointers(views, num_kv_heads, head_dim)
    if layers is None:
        return None
    try:
        step_fn = (kernel or load()).step_fn
    except NativeKernelUnavailable:
        return None
    k_ptrs, v_ptrs, (num_blocks, block_size, hkv, d) = layers
    rows, mask_starts, masks = ctx.num_tokens, None, None
    if decodes:
        tables, lens = ctx.block_tables[:rows], ctx.seq_lens[:rows]
    else:
        short = query_rows(ctx, ctx.num_seqs)
        tables, lens, mask_starts, masks = short.block_tables, short.seq_lens, short.mask_starts, short.masks
    slots = ctx.slot_mapping
    if tables.dtype != torch.int32 or not tables.is_contiguous() or not tables.is_cpu:
        tables = tables.to("cpu", torch.int32).contiguous()
    if lens.dtype != torch.int32 or not lens.is_contiguous() or not lens.is_cpu:
        lens = lens.to("cpu", torch.int32).contiguous()
    if slots.dtype != torch.int64 or not slots.is_contiguous() or not slots.is_cpu:
        slots = slots.to("cpu", torch.int64).contiguous()
    if tables.dim() != 2 or tables.shape[0] != rows or lens.shape != (rows,) or slots.shape != (rows,):
        raise ValueError(f"{_WHAT}: block_tables must be [{rows}, max_blocks], seq_lens and slot_mapping "
                         f"[{rows}], got {tuple(tables.shape)}, {tuple(lens.shape)}, {tuple(slots.shape)}")
    if masks is not None:
        mask_starts, masks = mask_starts.to("cpu").contiguous(), masks.to("cpu").contiguous()
    q = torch.empty(rows, num_heads, head_dim, dtype=torch.float32)
    desc = _StepAttention(ctypes.addressof(k_ptrs), ctypes.addressof(v_ptrs), len(views), tables.data_ptr(),
                          tables.stride(0), lens.data_ptr(), slots.data_ptr(), rows, num_heads, hkv, d, block_size,
                          num_blocks * block_size, sliding_window or 0, scale, q.data_ptr(), 0,
                          None if masks is None else mask_starts.data_ptr(),
                          None if masks is None else masks.data_ptr(),
                          *(ctypes.addressof(a) for a in per_layer or ()))
    return NativeCall(step_fn, ctypes.addressof(desc), (desc, layers, per_layer, tables, lens, slots, q, mask_starts, masks),
                      name, STEP_ERRORS)


@functools.lru_cache(maxsize=16)
def _per_layer(specs: tuple, count: int) -> tuple | None:
    """(scales, soft-caps, windows) of ``specs`` as ``decode_step_attention`` reads them, or None
    where some layer has sinks or the layers do not cover the ``count`` cache layers."""
    if len(specs) < count or any(spec.sinks for spec in specs[:count]):
        return None
    return ((ctypes.c_float * count)(*[spec.scale for spec in specs[:count]]),
            (ctypes.c_float * count)(*[spec.softcap or 0.0 for spec in specs[:count]]),
            (ctypes.c_int64 * count)(*[spec.sliding_window or 0 for spec in specs[:count]]))
