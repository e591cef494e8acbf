"""GGUF weights multiplied in their packed blocks (``quant: {method: gguf}``).

A GGUF whose linear weights are quantized says ``quant_method: gguf`` (the reader's
``quantization_config``), so this method is chosen like any checkpoint's. On CPU it takes the
weights as the reader leaves them (``PackedTensor``: the file's bytes, zero-copy; fused q/k/v
and gate/up shards that lie back to back in the file stay one view) and multiplies by them:
the native kernel (``gguf_native``: ``torch.ops.lmplug_quant.gguf_mul_mat``) where it is built
and reads the type, else the PyTorch reference (``gguf_ref``: dequantize per call, then
``F.linear``; no float copy of a weight persists). The token embedding and LM head go through
it too (``takes_packed``), so the tied ``token_embd`` table stays packed: a lookup dequantizes
the step's rows only.

Shards of one fused layer may have different types (k-quant files: Q4_K q/k with Q6_K v):
runs of equal type are multiplied together and their outputs concatenated. The packed types:
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS (``gguf_ref.SUPPORTED``).
Types the reference does not read (Q2_K, the 1-3-bit IQ types, ...) are dequantized once at
load, with one log line naming the tensor. ``dequantize_at_load: true``, CUDA, and tensor-parallel slices
(which the loader hands over dense) keep dense float weights, as for a float checkpoint.

MXFP4 shards (GPT-OSS's experts in llama.cpp's files) are repacked as they load into the ``mxfp4``
method's layout (``mxfp4_ref.from_ggml``: bytes only, no float copy); a layer of MXFP4 shards only is
then multiplied by that method (its native C kernel on the CPU), the path HF's MXFP4 checkpoints
take (beside shards of other types, they are dequantized at load).
"""

from __future__ import annotations

import functools
import logging
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from lmplug_quant import gguf_ref, mxfp4_ref
from lmplug_quant.mxfp4 import MXFP4, MXFP4Options
from pydantic import Field

from lmplug.api import BackendOptions, Capabilities, PackedTensor, QuantMethod, Unquantized
from lmplug.errors import ConfigError
from lmplug.kit import extras, native_build
from lmplug.kit.file_pages import release_file_pages

logger = logging.getLogger(__name__)
MXFP4_TYPE = int(GGMLQuantizationType.MXFP4)  # block_mxfp4: repacked for the ``mxfp4`` method


class GGUFOptions(BackendOptions):
    dequantize_at_load: bool = Field(
        default=False, description="dequantize every weight to a dense float one at load (the "
        "float-checkpoint path: BLAS speed, about 3x the memory of the packed blocks)")
    kernel: Literal["auto", "native", "torch"] = Field(
        default="auto", description="matmul on the packed blocks: native (the C kernel, compiled on "
        "first use), torch (the PyTorch reference: dequantize per call, slow); auto: native where it "
        "builds and reads the type, else torch")


@functools.cache
def native_kernel() -> tuple[object | None, str]:
    """(the ``gguf_native`` module, "") where its op is built, else (None, why not)."""
    try:
        from lmplug_quant import gguf_native
    except ImportError as exc:
        return None, f"the native GGUF kernel module is not installed ({exc})"
    ok, reason = gguf_native.available()
    return (gguf_native, "") if ok else (None, reason)


native_build.declare("gguf_mul_mat", native_kernel)  # built at engine load, not in the first matmul


class MXFP4Shard(NamedTuple):
    """A ggml MXFP4 shard repacked at load (``mxfp4_ref.from_ggml``) into the ``mxfp4`` layout."""

    blocks: torch.Tensor
    scales: torch.Tensor


class GGUFQuant(QuantMethod, extras.PackedWeights, extras.OwnThreads, extras.NativeProduct):
    name = "gguf"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options = GGUFOptions

    def __init__(self, options: GGUFOptions) -> None:
        super().__init__(options)
        # chosen once, not per matmul (121 a decode token on the demo model)
        self._native, why = native_kernel() if options.kernel != "torch" else (None, "")
        if options.kernel == "native" and self._native is None:
            raise ConfigError(f"quant: gguf: kernel 'native' is not available: {why}; "
                              "use `kernel: auto` or `kernel: torch`")

    def takes_packed(self, device: torch.device) -> bool:
        return not self.options.dequantize_at_load and torch.device(device).type == "cpu"

    def own_threads(self, device: torch.device) -> bool:
        """The native kernel's thread pool does the products (dense fallbacks aside)."""
        return self._native is not None and self.takes_packed(device)

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        # a placeholder the loader addresses by name; the shards arrive through load_shard
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                      if bias else None)
        layer.gguf_shards = {}  # output offset -> PackedTensor or dense tensor
        layer.gguf_runs = None  # after loading: [(ggml type or None for dense, buffer name, rows)]
        layer.gguf_calls = None  # after loading, where the native kernel reads every run: their products
        layer.gguf_mxfp4 = None  # after loading MXFP4 shards: the mxfp4 method that multiplies them

    def load_shard(self, layer, param_name, tensor, shard_offset, shard_size):
        if param_name != "weight":
            super().load_shard(layer, param_name, tensor, shard_offset, shard_size)
            return
        expected = (shard_size, layer.in_features)
        if tuple(tensor.shape) != expected:
            kind = f" of type {tensor.type_name}" if isinstance(tensor, PackedTensor) else ""
            raise ValueError(f"has shape {tuple(tensor.shape)}{kind}, the model expects {expected}")
        if isinstance(tensor, PackedTensor) and tensor.ggml_type == MXFP4_TYPE:
            tensor = MXFP4Shard(*mxfp4_ref.from_ggml(tensor.data))  # ValueError: the loader names the tensor
        elif not isinstance(tensor, PackedTensor):
            tensor = tensor.to(device=layer.weight.device, dtype=layer.dtype)
        layer.gguf_shards[shard_offset] = tensor

    def process_weights_after_loading(self, layer):
        shards = [piece for _, piece in sorted(layer.gguf_shards.items())]
        if shards and all(isinstance(p, MXFP4Shard) for p in shards):
            self._keep_mxfp4(layer, shards)
            return
        pieces = [self._usable(piece) for piece in shards]
        del layer.gguf_shards
        runs = _runs(pieces)
        if len(runs) == 1 and not isinstance(runs[0], PackedTensor):  # dense: as a float checkpoint
            layer.weight = torch.nn.Parameter(runs[0].to(layer.dtype), requires_grad=False)
            Unquantized().process_weights_after_loading(layer)
            return
        del layer.weight
        layer.gguf_runs = []
        for i, run in enumerate(runs):
            packed = isinstance(run, PackedTensor)
            data = run.data if packed else run.float()  # dense pieces of a mixed layer: float32
            layer.register_buffer(f"gguf_w{i}", data, persistent=False)
            layer.gguf_runs.append((run.ggml_type if packed else None, f"gguf_w{i}", run.shape[0]))
        layer.gguf_calls = self._bind(layer)

    def _keep_mxfp4(self, layer, shards: list[MXFP4Shard]) -> None:
        """The repacked MXFP4 shards as the ``mxfp4`` method's ``blocks`` / ``scales``, multiplied
        by that method from then on."""
        del layer.gguf_shards, layer.weight
        layer.register_buffer("blocks", torch.cat([p.blocks for p in shards]) if len(shards) > 1
                              else shards[0].blocks, persistent=False)
        layer.register_buffer("scales", torch.cat([p.scales for p in shards]) if len(shards) > 1
                              else shards[0].scales, persistent=False)
        mxfp4_ref.check(layer.blocks, layer.scales, layer.in_features)
        layer.gguf_mxfp4 = self._mxfp4

    @functools.cached_property
    def _kernel(self):
        """``gguf_native.load()``, once: it reads three environment variables, tens of microseconds
        in every decode step's embedding once the weights have swept the caches."""
        return self._native.load()

    @functools.cached_property
    def _mxfp4(self) -> MXFP4:
        """Built on the first MXFP4 layer (its native kernel compiles then)."""
        return MXFP4(MXFP4Options(kernel=self.options.kernel))

    def _bind(self, layer) -> list | None:
        """The native products of the layer's runs, checked once (``gguf_native.BoundProduct``),
        when the kernel reads every run's type; None: ``apply`` takes the op path. A run bound to
        a copy (panels, or rows in huge pages) whose rows are a copy made at load (llama's permuted
        q/k) keeps that copy only: its buffer is emptied and ``_rows`` gives the rows from it if
        the op path ever needs them."""
        native = self._native
        if native is None or any(kind not in native.SUPPORTED for kind, _, _ in layer.gguf_runs):
            return None
        kernel = native.load()
        calls = [native.BoundProduct(kernel, getattr(layer, buf), kind, layer.in_features)
                 for kind, buf, _ in layer.gguf_runs]
        layer.gguf_panels_only = {}  # buffer name -> the bound product holding the only copy
        for (kind, buf, _), call in zip(layer.gguf_runs, calls):
            if kernel.panels_only(getattr(layer, buf), kind, layer.in_features):
                setattr(layer, buf, torch.empty(0, dtype=torch.uint8))
                layer.gguf_panels_only[buf] = call
        return calls

    def _rows(self, layer, i: int) -> torch.Tensor:
        """Run ``i``'s packed rows (or dense float32 rows): the buffer, or, where ``_bind`` kept
        only the panels, the rows rebuilt from them (kept from then on)."""
        kind, buf, rows = layer.gguf_runs[i]
        call = getattr(layer, "gguf_panels_only", {}).pop(buf, None)
        if call is not None:  # the panels, or the rows themselves (copied into huge pages)
            setattr(layer, buf, call.w if call.w.dim() == 2 else
                    self._native.load().rows(call.w, kind, rows, layer.in_features))
        return getattr(layer, buf)

    def native_product(self, layer):
        """The layer's runs in one C call (``gguf_native.layer_product``), where every packed
        run is a type the native kernel reads and the dense ones and the bias are float32."""
        native = self._native
        if native is None or layer.gguf_mxfp4 is not None:
            return None
        if layer.gguf_runs is None:  # a layer stored in float (F16 / F32): W^T as Unquantized keeps it
            weight, bias = layer.weight, layer.bias
            if weight.dtype != torch.float32 or weight.t().stride(1) != 1 or (
                    bias is not None and bias.dtype != torch.float32):
                return None
            return native.layer_product(native.load(), [("t", weight.t())], layer.in_features, bias)
        if any(kind is not None and kind not in native.SUPPORTED and kind not in native.FLOAT_TYPES
               for kind, _, _ in layer.gguf_runs):
            return None
        if layer.bias is not None and layer.bias.dtype != torch.float32:
            return None
        calls = layer.gguf_calls  # bound: the weights as the products read them (panels, maybe alone)
        runs = [(kind, calls[i] if calls else getattr(layer, buf)) for i, (kind, buf, _) in enumerate(layer.gguf_runs)]
        if len(runs) > native.MAX_RUNS:
            return None
        return native.layer_product(native.load(), runs, layer.in_features, layer.bias)

    @staticmethod
    def _usable(piece):
        """A shard as this layer keeps it: packed where the reference reads its type, else
        dequantized (once, here)."""
        if isinstance(piece, MXFP4Shard):  # beside shards of other types in one layer
            return mxfp4_ref.dequantize(piece.blocks, piece.scales)
        if not isinstance(piece, PackedTensor):
            return piece
        if piece.ggml_type not in gguf_ref.SUPPORTED:
            logger.info("gguf: tensor %r has type %s, which no packed matmul reads: dequantized at load",
                        piece.name, piece.type_name)
            dense = piece.dequantize()
            release_file_pages(piece.data)  # read once for the copy: not resident beside it
            return dense
        return piece

    def apply(self, layer, x):
        if layer.gguf_mxfp4 is not None:
            return layer.gguf_mxfp4.apply(layer, x)
        if layer.gguf_runs is None:
            return F.linear(x, layer.weight, layer.bias)
        calls = layer.gguf_calls
        # the eager hot path (a decode step's 2-D float32 rows): straight to the bound kernels;
        # traced / compiled code and every other input take the registered op below
        if (calls is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
                and x.is_cpu and not torch.compiler.is_compiling()):
            y = calls[0](x) if len(calls) == 1 else torch.cat([call(x) for call in calls], dim=-1)
            return y if layer.bias is None else y.add_(layer.bias)
        xf = x.reshape(-1, x.shape[-1]).float().contiguous()
        if calls is not None and x.is_cpu and not torch.compiler.is_compiling():  # e.g. bfloat16 rows
            outs = [call(xf) for call in calls]
        else:
            outs = [self._matmul(self._rows(layer, i), kind, xf, layer.in_features)
                    for i, (kind, _, _) in enumerate(layer.gguf_runs)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if layer.bias is not None:
            y = y + layer.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def _matmul(self, data: torch.Tensor, kind: int | None, xf: torch.Tensor, cols: int) -> torch.Tensor:
        if kind is None:
            return F.linear(xf, data)
        native = self._native
        if native is not None and kind in native.SUPPORTED:
            return torch.ops.lmplug_quant.gguf_mul_mat(xf, data, kind, cols)
        return gguf_ref.linear(xf, data, kind, cols)

    def embedding(self, layer, ids):
        """Only the rows looked up are dequantized (a packed vocabulary table stays packed)."""
        if layer.gguf_runs is None:
            return F.embedding(ids, layer.weight)
        flat = ids.reshape(-1)
        if len(layer.gguf_runs) == 1:  # one table (a decode step's lookup: no masks to build)
            kind = layer.gguf_runs[0][0]
            data = self._rows(layer, 0)[flat]
            rows = data if kind is None else self._dequantize(data, kind, layer.in_features)
            return rows.to(layer.dtype).reshape(*ids.shape, layer.in_features)
        out = torch.empty(flat.shape[0], layer.in_features, dtype=layer.dtype, device=flat.device)
        start = 0
        for i, (kind, _, rows) in enumerate(layer.gguf_runs):
            mine = (flat >= start) & (flat < start + rows)
            local = flat[mine] - start
            data = self._rows(layer, i)
            out[mine] = (data[local] if kind is None else
                         self._dequantize(data[local], kind, layer.in_features)).to(layer.dtype)
            start += rows
        return out.reshape(*ids.shape, layer.in_features)

    def _dequantize(self, data: torch.Tensor, kind: int, cols: int) -> torch.Tensor:
        """Looked-up rows as float32: the native kernel's C loops where it is built (the reference
        takes some thirty small tensor ops a lookup), the same bits."""
        native = self._native
        if native is not None and kind in native.SUPPORTED and data.is_cpu:
            return self._kernel.dequantize(data, kind, cols)
        return gguf_ref.dequantize(data, kind, cols)


def _runs(pieces: list) -> list:
    """Adjacent shards merged: packed ones of one type (a view where they lie back to back in
    the same buffer, else a packed copy), dense ones concatenated."""
    runs: list = []
    for piece in pieces:
        last = runs[-1] if runs else None
        if isinstance(piece, PackedTensor) and isinstance(last, PackedTensor) \
                and piece.ggml_type == last.ggml_type:
            runs[-1] = PackedTensor(_join(last.data, piece.data), last.ggml_type,
                                    (last.shape[0] + piece.shape[0], last.shape[1]), last.name)
        elif not isinstance(piece, PackedTensor) and last is not None and not isinstance(last, PackedTensor):
            runs[-1] = torch.cat([last, piece.to(last.dtype)])
        else:
            runs.append(piece)
    return runs


def _join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` then ``b``: a view when ``b`` starts where ``a`` ends in one storage, else a
    copy, and then the file's pages of the two are given back (``release_file_pages``: where they
    lie in the file's mapping, e.g. a Q4_K_M file's ffn_gate and ffn_up, 302 MB of a 1B model's,
    they would stay resident beside the copy)."""
    if a.is_contiguous() and b.is_contiguous() and a.device == b.device \
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() \
            and b.storage_offset() == a.storage_offset() + a.numel():
        return a.as_strided((a.shape[0] + b.shape[0], a.shape[1]), (a.shape[1], 1), a.storage_offset())
    out = torch.cat([a, b])
    if a.device.type == "cpu":
        release_file_pages(a)
        release_file_pages(b)
    return out
