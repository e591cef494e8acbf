"""Offline quantizers (``lmplug quantize MODEL OUT --method NAME``): read a float checkpoint,
calibrate on text that ships with Python, write a published format other engines load.

``rtn`` and ``gptq`` write GPTQ v1, ``awq`` the AWQ GEMM format, ``smoothquant`` (INT8 W8A8)
and ``fp8`` (FP8 W8A8) compressed-tensors checkpoints.
"""

from lmplug_quant.quantizers.awq import AWQQuantizer
from lmplug_quant.quantizers.fp8 import FP8Quantizer
from lmplug_quant.quantizers.gptq import GPTQQuantizer
from lmplug_quant.quantizers.rtn import RTNQuantizer
from lmplug_quant.quantizers.smoothquant import SmoothQuantQuantizer

QUANTIZERS = [RTNQuantizer, GPTQQuantizer, AWQQuantizer, SmoothQuantQuantizer, FP8Quantizer]

__all__ = ["QUANTIZERS", "AWQQuantizer", "FP8Quantizer", "GPTQQuantizer", "RTNQuantizer",
           "SmoothQuantQuantizer"]
