"""First-party quant methods. Registered through the ``lmplug.plugins`` entry point.

``rtn`` (round-to-nearest at load time), ``gptq`` and ``awq`` (packed
checkpoints); see ``common.py`` for how each runs on CPU and CUDA.
"""

from lmplug import hookimpl

LMPLUG_API_VERSION = 1


@hookimpl
def lmplug_register_quant_methods() -> list[type]:
    from lmplug_quant.awq import AWQ
    from lmplug_quant.gptq import GPTQ
    from lmplug_quant.rtn import RTN

    return [RTN, GPTQ, AWQ]
