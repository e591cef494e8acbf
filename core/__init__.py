"""lmplug: an LLM inference engine in which every optimization is a plugin.

The names below are imported on first use (PEP 562 ``__getattr__``), not with the package:
``import lmplug.cli`` must not pay for torch, pydantic and the engine before it knows which
command runs (``lmplug --help``, ``lmplug models list`` need none of them).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from lmplug.errors import ConfigError, LmplugError, ModelLoadError, PluginError

__version__ = "0.2.0"

# public name -> the module that defines it
_LAZY = {
    "API_VERSION": "lmplug.api",
    "LLM": "lmplug.llm",
    "LoRARequest": "lmplug.api",
    "AttentionBackend": "lmplug.api",
    "BackendOptions": "lmplug.api",
    "Capabilities": "lmplug.api",
    "CompletionOutput": "lmplug.outputs",
    "Drafter": "lmplug.api",
    "EngineConfig": "lmplug.config",
    "KVCacheBackend": "lmplug.api",
    "KVLayerView": "lmplug.api",
    "MoEBackend": "lmplug.api",
    "QuantMethod": "lmplug.api",
    "PoolingParams": "lmplug.outputs",
    "RequestOutput": "lmplug.outputs",
    "RoutingConfig": "lmplug.api",
    "SamplingParams": "lmplug.api",
    "BeamSearchParams": "lmplug.beam.api",
    "BeamSearchOutput": "lmplug.beam.api",
    "Scheduler": "lmplug.api",
    "StepContext": "lmplug.api",
    "hookimpl": "lmplug.hookspecs",
    "hookspec": "lmplug.hookspecs",
}

__all__ = [
    "API_VERSION",
    "LLM",
    "AttentionBackend",
    "BackendOptions",
    "BeamSearchOutput",
    "BeamSearchParams",
    "Capabilities",
    "CompletionOutput",
    "ConfigError",
    "Drafter",
    "EngineConfig",
    "KVCacheBackend",
    "KVLayerView",
    "LmplugError",
    "LoRARequest",
    "MoEBackend",
    "ModelLoadError",
    "PluginError",
    "PoolingParams",
    "QuantMethod",
    "RequestOutput",
    "RoutingConfig",
    "SamplingParams",
    "Scheduler",
    "StepContext",
    "hookimpl",
    "hookspec",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmplug' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:  # what type checkers and IDEs see; nothing runs here
    from lmplug.api import (
        AttentionBackend,
        BackendOptions,
        Capabilities,
        Drafter,
        KVCacheBackend,
        KVLayerView,
        MoEBackend,
        QuantMethod,
        RoutingConfig,
        Scheduler,
        StepContext,
    )
    from lmplug.beam.api import BeamSearchOutput, BeamSearchParams
    from lmplug.config import EngineConfig
    from lmplug.hookspecs import hookimpl, hookspec
    from lmplug.interfaces.params import SamplingParams
    from lmplug.llm import LLM
    from lmplug.outputs import CompletionOutput, RequestOutput
    from lmplug.plugins import API_VERSION
