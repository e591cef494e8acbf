"""First-party KV storage backends. Registered through the ``lmplug.plugins`` entry point."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_kvcache_backends() -> list[type]:
    from lmplug_kvcache.contiguous import ContiguousKVCache
    from lmplug_kvcache.paged import PagedKVCache

    return [ContiguousKVCache, PagedKVCache]
