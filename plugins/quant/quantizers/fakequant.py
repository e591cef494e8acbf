"""A PyTorch reference for W8A8 checkpoints (compressed-tensors, per-channel weights, dynamic
per-token activations): dequantized weights in the float twin, activations fake-quantized
before every linear. Used to measure a written fp8 / smoothquant folder where no engine
method loads it, and as a check of one that does."""

from __future__ import annotations

import torch
from lmplug_quant.quantizers.grid import fake_quantize_fp8_tokens, fake_quantize_int8_tokens
from lmplug_quant.quantizers.reference import FloatLlama

from lmplug.api import ModelSource
from lmplug.errors import ConfigError


class W8A8Reference:
    """``log_probs(ids, rows)`` like ``lmplug.evaluate.Scorer``, computed by ``FloatLlama``."""

    def __init__(self, source: ModelSource, max_len: int = 4096) -> None:
        """``source``: the checkpoint folder as the core reads it (``lmplug.loading.open_source``)."""
        qc = source.hf_config.get("quantization_config") or {}
        if qc.get("quant_method") != "compressed-tensors":
            raise ConfigError(f"{source.path}: not a compressed-tensors checkpoint")
        self.model = FloatLlama(source, max_len=max_len)
        t = self.model.tensors
        for key in [k for k in t if k.endswith(".weight_scale")]:
            name = key[: -len("_scale")]
            t[name] = t[name] * t.pop(key)
        kind = qc["config_groups"]["group_0"]["input_activations"]["type"]
        self.model.act_quant = fake_quantize_fp8_tokens if kind == "float" else fake_quantize_int8_tokens
        self.tokenizer = source.tokenizer

    @torch.inference_mode()
    def log_probs(self, ids: list[int], rows: range) -> torch.Tensor:
        logits = self.model.forward(torch.tensor([ids]))[0, rows.start:rows.stop]
        return torch.log_softmax(logits.double(), dim=-1)
