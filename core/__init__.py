"""lmplug: an LLM inference engine in which every optimization is a plugin."""

from lmplug.config import EngineConfig
from lmplug.errors import ConfigError, LmplugError, ModelLoadError, PluginError
from lmplug.hookspecs import hookimpl, hookspec
from lmplug.interfaces import (
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
from lmplug.interfaces.params import SamplingParams
from lmplug.llm import LLM
from lmplug.outputs import CompletionOutput, RequestOutput
from lmplug.plugins import API_VERSION

__version__ = "0.2.0"

__all__ = [
    "API_VERSION",
    "LLM",
    "AttentionBackend",
    "BackendOptions",
    "Capabilities",
    "CompletionOutput",
    "ConfigError",
    "Drafter",
    "EngineConfig",
    "KVCacheBackend",
    "KVLayerView",
    "LmplugError",
    "MoEBackend",
    "ModelLoadError",
    "PluginError",
    "QuantMethod",
    "RequestOutput",
    "RoutingConfig",
    "SamplingParams",
    "Scheduler",
    "StepContext",
    "hookimpl",
    "hookspec",
]
