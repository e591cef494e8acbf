"""The native decode step: a whole decode step's decoder layers in one C call.

At batch 1 on a CPU, a token of a small model is ~30 layers x ~12 ops, and the Python and
dispatch between them cost about as much as the products themselves. The core can run every
decoder layer of a decode step in one C call (``lmplug.kit.native_step``) when each
plugin on that path hands it a C function to call instead of a Python method:

- a quant method, per linear layer: ``NativeProduct.native_product(layer)`` (``lmplug.kit.extras``), a ``NativeCall``
  to a ``PRODUCT_ABI`` function;
- the attention backend, per step: ``NativeDecode.native_decode(ctx, views)`` (``lmplug.kit.extras``), a
  ``NativeCall`` to an ``ATTENTION_ABI`` function.

The core does the rest in C itself (RMSNorm, the residual adds, RoPE, SiLU * mul: the same
functions as its fused CPU ops, so those steps give the same bits). A plugin that returns
None (the default) keeps the Python path, which stays the reference.

The two C signatures (all float data float32, contiguous unless a stride is given; every
function returns 0, or a nonzero code the core reports with the plugin's name):

``PRODUCT_ABI``::

    int product(void *ctx, const float *x, int64_t m, float *out, int threads);

``out[m, out_features] = x[m, in_features] @ W^T (+ bias)`` for the layer ``ctx`` describes;
``threads``: the threads it may split the product across (``threads.compute_threads()``).

A product that splits its work over a pool of threads of its own may hand that pool's entry in
``NativeCall.parallel_for`` (the GGUF kernels do), so that a plugin wrapping the product (the
adapter family's LoRA update) runs its own work on the same threads instead of a second pool::

    void parallel_for(void (*range)(const void *ctx, int64_t n0, int64_t n1), const void *ctx,
                      int64_t n, int threads);

calls ``range`` over pieces covering [0, n) on up to ``threads`` threads (the caller among them)
and returns when all are done.

``ATTENTION_ABI``::

    int attention(void *ctx, int64_t layer, const float *qkv, int64_t qkv_stride,
                  float *out, int threads);

For this step's rows (its query tokens in the step's order: one per decoding sequence, ``k + 1``
for a speculative verify of ``k`` drafts, a draft tree's nodes), row t of ``qkv`` at
``qkv + t * qkv_stride`` holds q [H, D] (RoPE applied), k [Hkv, D] (RoPE applied) and v [Hkv, D]
back to back; the function stores every row's k and v in cache layer ``layer`` at the step's
slots, then writes the attention output [H, D] of row t at ``out + t * H * D`` (row t attends
causally, or through its draft tree's mask, to its sequence's cache, the step's rows included).

``call_product`` and ``call_attention`` call either from Python (the tests and the
conformance suite, ``lmplug.testing``, compare them with ``apply`` and ``forward``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

PRODUCT_ABI = "int (*)(void *ctx, const float *x, int64_t m, float *out, int threads)"
ATTENTION_ABI = ("int (*)(void *ctx, int64_t layer, const float *qkv, int64_t qkv_stride, float *out, "
                 "int threads)")


@dataclass(frozen=True)
class NativeCall:
    """A C function (its address) and the context pointer it is called with. ``keep`` holds
    whatever must stay alive while the call may happen (the ctypes struct behind ``ctx``, the
    tensors it points into, the loaded library); the core keeps the ``NativeCall``."""

    fn: int
    ctx: int
    keep: object = None
    name: str = ""  # who provides it, for error messages (e.g. "quant gguf")
    errors: dict[int, str] | None = None  # what its nonzero codes mean, for error messages
    parallel_for: int | None = None  # the address of the product's pool's ``parallel_for`` (module docstring)

    def describe(self, status: int) -> str:
        """``"<name>'s native function returned error <status> (<meaning>)"``."""
        meaning = (self.errors or {}).get(status)
        return (f"{self.name or 'a plugin'}'s native function returned error {status}"
                + (f" ({meaning})" if meaning else ""))


_PRODUCT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_int)
_ATTENTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_int)


def call_product(call: NativeCall, x: torch.Tensor, out_features: int, threads: int = 1) -> torch.Tensor:
    """Call a ``PRODUCT_ABI`` function from Python (tests, the conformance suite): x float32
    [m, in_features] -> float32 [m, out_features]; RuntimeError with its code when it fails."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    status = _PRODUCT(call.fn)(call.ctx, x.data_ptr(), x.shape[0], out.data_ptr(), threads)
    if status:
        raise RuntimeError(call.describe(status))
    return out


def call_attention(call: NativeCall, layer: int, qkv: torch.Tensor, num_heads: int, head_dim: int,
                   threads: int = 1) -> torch.Tensor:
    """Call an ``ATTENTION_ABI`` function from Python: qkv float32 [T, (H + 2 Hkv) D] (rows
    contiguous) -> the attention output float32 [T, H, D]; RuntimeError with its code when it fails."""
    if qkv.dtype != torch.float32 or qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError(f"call_attention: qkv must be float32 [T, (H + 2 Hkv) D] with dense rows, got "
                         f"{qkv.dtype} {tuple(qkv.shape)}")
    out = torch.empty(qkv.shape[0], num_heads, head_dim, dtype=torch.float32)
    status = _ATTENTION(call.fn)(call.ctx, layer, qkv.data_ptr(), qkv.stride(0), out.data_ptr(), threads)
    if status:
        raise RuntimeError(call.describe(status))
    return out
