"""INT8 W8A8, SmoothQuant-style (``quant_method: int8``): int8 weights and activations.

Weights: int8 ``[out, in]`` with one float scale per output channel
(``weight_scale [out, 1]``), symmetric. Activations: int8, symmetric, one
scale per token computed at run time (``activation_scheme: dynamic``) or the
checkpoint's per-tensor ``input_scale`` (``static``). SmoothQuant's smoothing
factors are folded into the previous norm / linear by the offline quantizer,
so the checkpoint is plain W8A8. ``quant: {method: int8}`` on a float
checkpoint quantizes the weights per channel at load time (no smoothing).

The product is exact in int32 (``torch._int_mm`` on CPU, ``tl.dot`` on int8
in the Triton kernel) and scaled by token x channel scales afterwards; see
``w8a8_common``. (Most int8 W8A8 checkpoints in the wild are compressed-tensors
"int-quantized", which the ``compressed-tensors`` method reads.)
"""

from __future__ import annotations

from lmplug_quant.w8a8_common import CheckpointW8A8Options, W8A8Linear, W8A8Scheme


class INT8Options(CheckpointW8A8Options):
    pass


class INT8(W8A8Linear):
    name = "int8"
    Options = INT8Options

    @classmethod
    def from_checkpoint_config(cls, quantization_config):
        config = {**quantization_config, "quantized_checkpoint": True}
        return cls.Options(**{k: v for k, v in config.items() if k in cls.Options.model_fields})

    def make_scheme(self, options: INT8Options) -> W8A8Scheme:
        act = "static" if options.activation_scheme == "static" else "token"
        return W8A8Scheme(kind="int8", weight_strategy="channel", act=act,
                          serialized=options.quantized_checkpoint, method=self.name)
