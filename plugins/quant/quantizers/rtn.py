"""``rtn``: round-to-nearest, symmetric, per group; written in the GPTQ v1 format (identity
``g_idx``, ``sym: true``) so every GPTQ-capable engine loads it. No calibration: the baseline
the calibrated methods are measured against."""

from __future__ import annotations

import torch
from lmplug_quant.quantizers.base import BaseQuantizer, GroupOptions, prefix
from lmplug_quant.quantizers.formats import gptq_config, gptq_tensors
from lmplug_quant.quantizers.grid import quantize_groups


class RTNQuantizer(BaseQuantizer):
    name = "rtn"
    Options = GroupOptions
    needs_calibration = False

    def quantize_model(self, model, windows, progress):
        o = self.options
        tensors: dict[str, torch.Tensor] = {}
        n = model.cfg.num_layers
        for i in range(n):
            for linear in model.linears:
                w = model.weight(i, linear)
                q, scales, zeros = quantize_groups(w, o.bits, o.group_size, sym=True)
                g = w.shape[1] if o.group_size == -1 else o.group_size
                g_idx = torch.arange(w.shape[1]) // g
                tensors.update(gptq_tensors(prefix(i, linear), q, scales, zeros, g_idx, o.bits, o.dtype))
            progress("rtn: layers", i + 1, n)
        return tensors, gptq_config(o.bits, o.group_size, desc_act=False, sym=True)
