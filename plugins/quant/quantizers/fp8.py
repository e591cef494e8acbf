"""``fp8``: FP8 W8A8 as a compressed-tensors "float-quantized" checkpoint.

Weights: per output channel, ``scale = max|W_row| / 448`` (the largest finite
e4m3 value), ``weight = (W / scale)`` cast to ``float8_e4m3fn``; activations are
quantized dynamically per token by the engine. No calibration."""

from __future__ import annotations

import torch
from lmplug_quant.quantizers.base import BaseQuantizer, QuantizerOptions, prefix
from lmplug_quant.quantizers.formats import channel8_tensors, compressed_tensors_config

FP8_MAX = 448.0


def fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight float8_e4m3fn [out, in], scale float32 [out])``."""
    scale = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class FP8Quantizer(BaseQuantizer):
    name = "fp8"
    Options = QuantizerOptions
    needs_calibration = False

    def quantize_model(self, model, windows, progress):
        tensors: dict[str, torch.Tensor] = {}
        n = model.cfg.num_layers
        for i in range(n):
            for linear in model.linears:
                tensors.update(channel8_tensors(prefix(i, linear), *fp8_channel(model.weight(i, linear))))
            progress("fp8: layers", i + 1, n)
        return tensors, compressed_tensors_config("float")
