"""An example lmplug plugin: registers the ``chunked`` attention backend and the ``arcee``
architecture (built on the kit, ``lmplug.kit``).

lmplug imports this module through the entry point ``example`` in the group
``lmplug.plugins`` (see pyproject.toml), checks ``LMPLUG_API_VERSION``, and
calls the hooks below when it builds its registry.
"""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3  # the lmplug core API this plugin is written against


@hookimpl
def lmplug_register_attention_backends() -> list[type]:
    # import inside the hook: listing plugins stays cheap, the backend loads when it is needed
    from lmplug_example.chunked import ChunkedAttention

    return [ChunkedAttention]


@hookimpl
def lmplug_register_architectures() -> list[type]:
    from lmplug_example.arcee import ArceeArchitecture

    return [ArceeArchitecture]
