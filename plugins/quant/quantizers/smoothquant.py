"""``smoothquant``: SmoothQuant (Xiao et al., 2022) INT8 W8A8, as a compressed-tensors
"int-quantized" checkpoint.

Activation outliers live in a few input channels; SmoothQuant moves part of
their range into the weights: per input channel ``j`` of the linears after an
RMSNorm (q/k/v after ``input_layernorm``, gate/up after
``post_attention_layernorm``), ``s_j = max|X_j|^α / max|W_:j|^(1-α)`` over the
calibration activations and the largest weight of column ``j`` of any of those
linears (α = ``alpha``, the migration strength). ``1/s`` is folded into the
norm weight and ``s`` into the weight columns, which leaves the float model
unchanged. The smoothed weights are then quantized per output channel,
symmetric int8 (``scale = max|W_row| / 127``); activations are quantized per
token at run time by the engine.
"""

from __future__ import annotations

import torch
from lmplug_quant.quantizers.awq import fold_scales
from lmplug_quant.quantizers.base import BaseQuantizer, QuantizerOptions, prefix, split_windows
from lmplug_quant.quantizers.formats import channel8_tensors, compressed_tensors_config
from lmplug_quant.quantizers.reference import LINEARS, FloatLlama
from pydantic import Field

GROUPS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))


class SmoothQuantOptions(QuantizerOptions):
    alpha: float = Field(default=0.5, ge=0, le=1, description="migration strength: the share of the "
                         "activation range moved into the weights")


def int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight int8 [out, in], scale float32 [out])``, symmetric per output channel."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def smooth_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w_max = torch.cat(weights).abs().amax(0)
    return (act_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)


def activation_maxima(model: FloatLlama, windows: torch.Tensor, progress) -> list[dict[str, torch.Tensor]]:
    """Per layer, ``max |x_j|`` over all calibration tokens of the two norms' outputs."""
    out = []
    n = model.cfg.num_layers
    xs = [model.embed(w) for w in split_windows(windows)]
    for i in range(n):
        stats = {"input_layernorm": 0, "post_attention_layernorm": 0}
        nxt = []
        for x in xs:
            a = model.attn_input(i, x)
            x2 = model.attn_output(i, x, model.attn_context(i, a))
            m = model.mlp_input(i, x2)
            stats["input_layernorm"] = torch.maximum(torch.as_tensor(stats["input_layernorm"]),
                                                     a.abs().amax((0, 1)))
            stats["post_attention_layernorm"] = torch.maximum(torch.as_tensor(stats["post_attention_layernorm"]),
                                                              m.abs().amax((0, 1)))
            nxt.append(model.mlp_output(i, x2, model.down_input(i, m)))
        xs = nxt
        out.append(stats)
        progress("smoothquant: statistics", i + 1, n)
    return out


def smooth(model: FloatLlama, maxima: list[dict[str, torch.Tensor]], alpha: float) -> None:
    """Fold the smoothing scales into every layer (the float function is unchanged)."""
    for i, stats in enumerate(maxima):
        for norm, linears in GROUPS:
            s = smooth_scales(stats[norm], [model.weight(i, n) for n in linears], alpha)
            fold_scales(model, i, s, norm, linears)


class SmoothQuantQuantizer(BaseQuantizer):
    name = "smoothquant"
    Options = SmoothQuantOptions

    def quantize_model(self, model, windows, progress):
        with torch.no_grad():
            smooth(model, activation_maxima(model, windows, progress), self.options.alpha)
        tensors: dict[str, torch.Tensor] = {}
        for i in range(model.cfg.num_layers):
            for linear in LINEARS:
                tensors.update(channel8_tensors(prefix(i, linear), *int8_channel(model.weight(i, linear))))
        return tensors, compressed_tensors_config("int")
