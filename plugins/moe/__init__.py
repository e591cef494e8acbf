"""First-party moe backends. Registered through the ``lmplug.plugins`` entry point."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_moe_backends() -> list[type]:
    from lmplug_moe.fused import FusedMoE
    from lmplug_moe.reference import ReferenceMoE

    return [ReferenceMoE, FusedMoE]
