"""First-party KV connectors: tiers for the paged cache's prefix blocks. Registered through the
``lmplug.plugins`` entry point."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_kvconnectors() -> list[type]:
    from lmplug_kvconnector.disk import DiskConnector
    from lmplug_kvconnector.host import HostConnector
    from lmplug_kvconnector.torch_distributed import TorchDistributedConnector

    return [HostConnector, DiskConnector, TorchDistributedConnector]
