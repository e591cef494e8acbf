"""First-party attention backends. Registered through the ``lmplug.plugins`` entry point."""

from lmplug.hookspecs import hookimpl

LMPLUG_API_VERSION = 2


@hookimpl
def lmplug_register_attention_backends() -> list[type]:
    from lmplug_attention.flash import FlashAttention
    from lmplug_attention.mla import MLAAttention
    from lmplug_attention.paged import PagedAttention
    from lmplug_attention.sdpa import SdpaAttention

    return [SdpaAttention, PagedAttention, FlashAttention, MLAAttention]
