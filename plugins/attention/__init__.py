"""First-party attention backends: sdpa, paged (paged/), flash (flash/) and mla (mla/).
Registered through the ``lmplug.plugins`` entry point."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_attention_backends() -> list[type]:
    from lmplug_attention.flash.backend import FlashAttention
    from lmplug_attention.mla.backend import MLAAttention
    from lmplug_attention.paged.backend import PagedAttention
    from lmplug_attention.sdpa import SdpaAttention

    return [SdpaAttention, PagedAttention, FlashAttention, MLAAttention]
