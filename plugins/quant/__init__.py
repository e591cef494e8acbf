"""First-party quant methods. Registered through the ``lmplug.plugins`` entry point.

``rtn`` (round-to-nearest at load time), ``gptq`` and ``awq`` (packed
checkpoints); see ``common.py`` for how each runs on CPU and CUDA. W8A8:
``fp8``, ``int8`` (``w8a8_common.py``), and ``compressed-tensors`` checkpoints. ``gguf``:
llama.cpp's block-quantized weights, multiplied packed (``gguf.py``). ``mxfp4``: MXFP4 experts
(GPT-OSS), multiplied packed (``mxfp4.py``).
"""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_quant_methods() -> list[type]:
    from lmplug_quant.awq import AWQ
    from lmplug_quant.compressed_tensors import CompressedTensors
    from lmplug_quant.fp8 import FP8
    from lmplug_quant.gguf import GGUFQuant
    from lmplug_quant.gptq import GPTQ
    from lmplug_quant.int8 import INT8
    from lmplug_quant.mxfp4 import MXFP4
    from lmplug_quant.rtn import RTN

    return [RTN, GPTQ, AWQ, FP8, INT8, CompressedTensors, GGUFQuant, MXFP4]


@hookimpl
def lmplug_register_quantizers() -> list[type]:
    """Offline quantizers (``lmplug quantize``): rtn, gptq, awq, smoothquant, fp8."""
    from lmplug_quant.quantizers import QUANTIZERS

    return list(QUANTIZERS)
