"""The first-party LoRA backends against the family's conformance suite."""

from lmplug.testing import AdapterConformance


class TestTorchLoRA(AdapterConformance):
    backend = "torch"
