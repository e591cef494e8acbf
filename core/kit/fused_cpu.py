"""Fused float32 CPU ops for the decoder (``csrc/fused_cpu_ops.c``): RMSNorm, add + RMSNorm,
SiLU * mul, tanh-GELU * mul and in-place RoPE, one C call each.

Why: at batch 1 the elementwise work between the GEMVs is a few hundred floats, and what a
token pays for is the number of ops, not their arithmetic. torch's RMSNorm is ~24 ATen
calls, rotate-half RoPE ~20 per tensor, split + SiLU + mul ~5; each of these is one ctypes
call here, single-threaded (no parallel region over 576 floats), allocating nothing but its
output. (``torch.compile`` of the same ops, inductor on the CPU, was measured too: about
70 us a call against 15 for these on a loaded 2-core machine, and 10 to 110 s to compile.)

The library is built on first use and cached (``lmplug.kit.native_build``). Where it
cannot be built, or for another device or dtype, or with ``LMPLUG_FUSED_CPU=0`` in the
environment (or ``set_enabled(False)``), the callers in ``layers.py`` keep the PyTorch path,
which stays the reference the tests compare against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from lmplug.kit.native_build import NativeBuildError, compiler, declare, shared_library
from lmplug.kit.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "fused_cpu_ops.c"
# -ffp-contract=off: RoPE's products and sums round as torch's separate mul / add do;
# -fno-math-errno -fno-trapping-math let GCC vectorise the loops (no result changes)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "rms_norm_f32": [_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _F32],
    "add_rms_norm_f32": [_P, _P, _P, _P, _P, _I64, _I64, _F32],
    "silu_mul_f32": [_P, _I64, _P, _I64, _I64],
    "gelu_tanh_mul_f32": [_P, _I64, _P, _I64, _I64],
    "rope_f32": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64],
    "decode_step_f32": [_P, _I64, _P, _P, _P],  # native_step.py
}

_state = {"enabled": os.environ.get("LMPLUG_FUSED_CPU", "1").strip().lower() not in ("0", "false", "no", "off")}


def set_enabled(on: bool) -> None:
    """Turn the fused path on or off for the whole process (benchmarks compare the two)."""
    _state["enabled"] = bool(on)


@functools.cache
def _library(cc: tuple[str, ...], root: str) -> ctypes.CDLL | None:
    try:
        lib, _ = shared_library(SOURCE, FLAGS, cc, Path(root))
    except NativeBuildError as exc:
        logger.warning("fused CPU ops unavailable, the model keeps the PyTorch path: %s", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library (built on first use), None where it cannot be built here."""
    return _library(compiler(), str(cache_dir()))


declare("fused_cpu", library)  # built at engine load, not in the first forward


def active(x: torch.Tensor) -> ctypes.CDLL | None:
    """The library when ``x`` takes the fused path (enabled, a float32 CPU tensor, the
    library built, no autograd: the C ops record no graph), else None. Called per op: the
    library is looked up once per process."""
    # is_cpu rather than device.type: this runs for every norm, RoPE and SiLU of a decode step
    if not _state["enabled"] or x.dtype != torch.float32 or not x.is_cpu or x.requires_grad:
        return None
    if "lib" not in _state:
        _state["lib"] = library()
    return _state["lib"]


def _rows(x: torch.Tensor, what: str) -> tuple[int, int, int, int]:
    """``x`` [..., n] (last dim dense) as (outer, outer_stride, inner, inner_stride) rows."""
    if x.stride(-1) != 1:
        raise ValueError(f"{what}: the last dimension must be contiguous, got strides {x.stride()}")
    if x.dim() == 1:
        return 1, 0, 1, 0
    if x.dim() == 2:
        return x.shape[0], x.stride(0), 1, 0
    if x.dim() == 3:
        return x.shape[0], x.stride(0), x.shape[1], x.stride(1)
    if x.is_contiguous():
        return x.numel() // x.shape[-1], x.shape[-1], 1, 0
    raise ValueError(f"{what}: expected at most 3 dims or a contiguous tensor, got {tuple(x.shape)} "
                     f"with strides {x.stride()}")


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [..., n] (rows may be strided views) into a new contiguous tensor."""
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous float32 ({n},), got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    outer, outer_stride, inner, inner_stride = _rows(x, "rms_norm")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # ~1 us; empty(x.shape, ...) ~3
    lib.rms_norm_f32(x.data_ptr(), outer, outer_stride, inner, inner_stride, weight.data_ptr(),
                     out.data_ptr(), n, eps)
    return out


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x + residual``, its RMSNorm); the sum is written into ``x``, which must be a tensor
    the caller owns (a layer's fresh output). Both contiguous [..., n] of one shape."""
    n = x.shape[-1]
    if x.shape != residual.shape or not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError(f"add_rms_norm: x and residual must be contiguous tensors of one shape, got "
                         f"{tuple(x.shape)} and {tuple(residual.shape)}")
    if weight.shape != (n,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight must be contiguous float32 ({n},), got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out = torch.empty_like(x)  # x is contiguous
    lib.add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                         x.numel() // n if n else 0, n, eps)
    return x, out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2n] (gate first) -> [T, n]."""
    return _gated(lib.silu_mul_f32, gate_up, "silu_mul")


def gelu_tanh_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU) of ``gate_up`` [T, 2n] (gate first) -> [T, n]."""
    return _gated(lib.gelu_tanh_mul_f32, gate_up, "gelu_tanh_mul")


def _gated(fn, gate_up: torch.Tensor, what: str) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"{what}: expected [T, 2n] with dense rows, got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)  # the fused path's only dtype
    fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n)
    return out


def rope_qk_(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> None:
    """``rope_`` of q [T, Hq, D] and k [T, Hk, D], in place: one C call over Hq + Hk heads where
    k's heads follow q's in every token's row (the views of a fused q/k/v projection), else one
    call each."""
    d = q.shape[-1]
    if (q.dim() == 3 and k.dim() == 3 and k.shape[0] == q.shape[0] and k.shape[2] == d
            and k.stride(0) == q.stride(0) and k.data_ptr() == q.data_ptr() + q.shape[1] * d * q.element_size()):
        heads = q.shape[1] + k.shape[1]
        rope_(lib, q.as_strided((q.shape[0], heads, d), q.stride()), positions, cos, sin)
        return
    rope_(lib, q, positions, cos, sin)
    rope_(lib, k, positions, cos, sin)


def rope_(lib: ctypes.CDLL, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate-half RoPE of ``x`` [T, N, D] in place (heads D apart, any token stride);
    ``positions`` int64 [T], ``cos`` / ``sin`` float32 [P, D] tables."""
    tokens, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or d % 2:
        raise ValueError(f"rope: x must be [T, N, D] with dense heads and an even D, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if positions.dtype != torch.int64 or positions.shape != (tokens,) or not positions.is_contiguous():
        raise ValueError(f"rope: positions must be a contiguous int64 tensor of shape ({tokens},), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or cos.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rope: cos and sin must be contiguous float32 [P, {d}] tables, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    bad = lib.rope_f32(x.data_ptr(), x.stride(0), d, heads, positions.data_ptr(), tokens, cos.data_ptr(),
                       sin.data_ptr(), cos.shape[0], d)
    if bad:
        raise IndexError(f"rope: position {int(positions[bad - 1])} of token {bad - 1} is outside the "
                         f"precomputed table [0, {cos.shape[0]})")
