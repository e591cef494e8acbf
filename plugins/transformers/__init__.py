"""The ``transformers`` architecture: any decoder-only causal LM transformers can build, run
through lmplug's scheduler, KV caches and attention backends. Registered through the
``lmplug.plugins`` entry point; transformers itself is imported only when a model is built."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_architectures() -> list[type]:
    from lmplug_transformers.architecture import TransformersArchitecture

    return [TransformersArchitecture]
