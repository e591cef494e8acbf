"""The conformance suite for plugin authors: one base test class per extension point.

Subclass the family's class in a test module, name the backend, and run pytest::

    from lmplug.testing import AttentionConformance

    class TestMyAttention(AttentionConformance):
        backend = "mine"

The pytest plugin (``lmplug.testing.pytest_plugin``, registered under
``pytest11``) is loaded automatically wherever lmplug is installed. The
guide is ``docs/plugins.md``; ``python -m lmplug.testing FAMILY NAME``
runs the suite on one installed backend without a test file.

The classes are imported on first use, so that loading the pytest plugin
does not import hypothesis (or anything else) before pytest has set up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AcceptanceConformance": "lmplug.testing.acceptance",
    "AdapterConformance": "lmplug.testing.adapter",
    "ArchitectureConformance": "lmplug.testing.architecture",
    "AttentionConformance": "lmplug.testing.attention",
    "CompressorConformance": "lmplug.testing.compressor",
    "BATCH_SPECS": "lmplug.testing.batches",
    "BatchSpec": "lmplug.testing.batches",
    "Conformance": "lmplug.testing.base",
    "ConstraintConformance": "lmplug.testing.constraint",
    "DrafterConformance": "lmplug.testing.drafter",
    "KVCacheConformance": "lmplug.testing.kvcache",
    "KVConnectorConformance": "lmplug.testing.kvconnector",
    "MixerConformance": "lmplug.testing.mixer",
    "MoEConformance": "lmplug.testing.moe",
    "QuantConformance": "lmplug.testing.quant",
    "SchedulerConformance": "lmplug.testing.scheduler",
    "StateCacheConformance": "lmplug.testing.state_cache",
}

__all__ = [
    "BATCH_SPECS",
    "AcceptanceConformance",
    "AdapterConformance",
    "ArchitectureConformance",
    "AttentionConformance",
    "BatchSpec",
    "CompressorConformance",
    "Conformance",
    "ConstraintConformance",
    "DrafterConformance",
    "KVCacheConformance",
    "KVConnectorConformance",
    "MixerConformance",
    "MoEConformance",
    "QuantConformance",
    "SchedulerConformance",
    "StateCacheConformance",
]

if TYPE_CHECKING:
    from lmplug.testing.acceptance import AcceptanceConformance as AcceptanceConformance
    from lmplug.testing.adapter import AdapterConformance as AdapterConformance
    from lmplug.testing.architecture import ArchitectureConformance as ArchitectureConformance
    from lmplug.testing.attention import AttentionConformance as AttentionConformance
    from lmplug.testing.base import Conformance as Conformance
    from lmplug.testing.batches import BATCH_SPECS as BATCH_SPECS
    from lmplug.testing.batches import BatchSpec as BatchSpec
    from lmplug.testing.compressor import CompressorConformance as CompressorConformance
    from lmplug.testing.constraint import ConstraintConformance as ConstraintConformance
    from lmplug.testing.drafter import DrafterConformance as DrafterConformance
    from lmplug.testing.kvcache import KVCacheConformance as KVCacheConformance
    from lmplug.testing.kvconnector import KVConnectorConformance as KVConnectorConformance
    from lmplug.testing.mixer import MixerConformance as MixerConformance
    from lmplug.testing.moe import MoEConformance as MoEConformance
    from lmplug.testing.quant import QuantConformance as QuantConformance
    from lmplug.testing.scheduler import SchedulerConformance as SchedulerConformance
    from lmplug.testing.state_cache import StateCacheConformance as StateCacheConformance


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmplug.testing' has no attribute {name!r}")
    from lmplug.testing.pytest_plugin import for_conformance

    for_conformance()  # before the suite's modules (and a backend's) import triton
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
