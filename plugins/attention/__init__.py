"""First-party attention backends and the mixer backends of state layers (linear attention, SSM).
Registered through the ``lmplug.plugins`` entry point."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_attention_backends() -> list[type]:
    from lmplug_attention.flash import FlashAttention
    from lmplug_attention.mla import MLAAttention
    from lmplug_attention.paged import PagedAttention
    from lmplug_attention.sdpa import SdpaAttention

    return [SdpaAttention, PagedAttention, FlashAttention, MLAAttention]


@hookimpl
def lmplug_register_mixer_backends() -> list[type]:
    from lmplug_attention.mixers import TorchMixer, TritonMixer

    return [TorchMixer, TritonMixer]
