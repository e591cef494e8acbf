"""MXFP4 checkpoints (``quantization_config.quant_method: mxfp4``, GPT-OSS's experts), multiplied packed.

HF's MXFP4 format quantizes the MoE experts only: a projection's ``*_blocks`` (uint8
``[out, in / 32, 16]``, two FP4 E2M1 values a byte) and ``*_scales`` (uint8 E8M0 ``[out, in / 32]``)
per expert (``mxfp4_ref`` has the format); every other layer is plain, so ``method_for_layer``
leaves them ``Unquantized``. The experts keep the blocks as loaded and multiply by them: on the CPU
the native kernel (``mxfp4_native``, C with AVX2) where it builds, else the PyTorch reference;
on CUDA the Triton kernel (``mxfp4_kernels``). ``dequantize_at_load: true`` turns them into dense
float weights at load instead (BLAS speed, about 4x the memory). Tensor parallelism slices the
blocks like any weight: output rows, or whole blocks of input features (``input_layout``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lmplug_quant import mxfp4_ref
from pydantic import Field

from lmplug.api import BackendOptions, Capabilities, QuantMethod, Unquantized
from lmplug.errors import ConfigError, ModelLoadError


class MXFP4Options(BackendOptions):
    dequantize_at_load: bool = Field(
        default=False, description="dequantize the MXFP4 experts to dense float weights at load (BLAS "
        "speed, about 4x the memory of the packed blocks)")
    kernel: Literal["auto", "native", "triton", "torch"] = Field(
        default="auto", description="products with the packed blocks: native (C on the CPU, compiled on "
        "first use), triton (CUDA), torch (the PyTorch reference: dequantize per call); auto: triton on "
        "CUDA, native on the CPU where it builds, else torch")


class MXFP4(QuantMethod):
    name = "mxfp4"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}),
                                dtypes=frozenset({"float32", "float16", "bfloat16"}))
    Options = MXFP4Options

    def __init__(self, options: MXFP4Options) -> None:
        super().__init__(options)
        self._native = None
        if options.kernel in ("auto", "native"):
            from lmplug_quant import mxfp4_native

            self._native, why = mxfp4_native.available()
            if options.kernel == "native" and self._native is None:
                raise ConfigError(f"quant: mxfp4: kernel 'native' is not available: {why}; "
                                  "use `kernel: auto` or `kernel: torch`")

    def method_for_layer(self, prefixes: list[str]) -> QuantMethod:
        """MXFP4 checkpoints quantize the MoE experts only."""
        return self if all(".experts." in prefix for prefix in prefixes) else Unquantized()

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        if in_features % mxfp4_ref.BLOCK:
            raise ModelLoadError(f"quant mxfp4: a layer of {in_features} input features, not a multiple of the "
                                 f"format's blocks of {mxfp4_ref.BLOCK}")
        groups = in_features // mxfp4_ref.BLOCK
        layer.blocks = torch.nn.Parameter(torch.zeros(out_features, groups, mxfp4_ref.BLOCK_BYTES, dtype=torch.uint8),
                                          requires_grad=False)
        layer.scales = torch.nn.Parameter(torch.zeros(out_features, groups, dtype=torch.uint8), requires_grad=False)
        layer.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                      if bias else None)

    def input_layout(self, layer, param_name):
        """Row-parallel slices: input features lie on axis 1 of blocks and scales, 32 an element."""
        if param_name in ("blocks", "scales"):
            return 1, mxfp4_ref.BLOCK
        return (1, 1) if param_name == "weight" else None

    def process_weights_after_loading(self, layer) -> None:
        mxfp4_ref.check(layer.blocks, layer.scales, layer.in_features)
        if self.options.dequantize_at_load:
            weight = mxfp4_ref.dequantize(layer.blocks.data, layer.scales.data, layer.dtype)
            del layer.blocks, layer.scales
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if "weight" in layer._parameters:  # dequantized at load
            return F.linear(x, layer.weight, layer.bias)
        kernel = self.options.kernel
        if x.is_cuda and kernel in ("auto", "triton"):
            from lmplug_quant import mxfp4_kernels

            return mxfp4_kernels.linear(x, layer.blocks, layer.scales, layer.bias)
        if self._native is not None and not x.is_cuda:
            return self._native.linear(x, layer.blocks, layer.scales, layer.bias).to(x.dtype)
        return mxfp4_ref.linear(x, layer.blocks, layer.scales, layer.bias)
