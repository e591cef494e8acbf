"""The first-party KV connectors against the conformance suite (``lmplug.testing.kvconnector``)."""

from typing import ClassVar

from lmplug.testing import KVConnectorConformance


class TestHostConnector(KVConnectorConformance):
    backend = "host"
    options: ClassVar[dict] = {"memory_gb": 0.01}


class TestDiskConnector(KVConnectorConformance):
    backend = "disk"

    def connector_options(self, tmp_path):
        return {"path": str(tmp_path / "tier"), "max_gb": 0.01}
