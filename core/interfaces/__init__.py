"""One small ABC per extension point, plus the records they share."""

from lmplug.interfaces.attention import AttentionBackend, KVLayerView, MLAAttentionBackend
from lmplug.interfaces.common import BackendInfo, BackendOptions, Capabilities
from lmplug.interfaces.drafter import Drafter, DrafterOptions, DraftProposal, DraftTarget
from lmplug.interfaces.kvcache import KVCacheBackend, KVCacheSpec
from lmplug.interfaces.moe import MoEBackend, RoutingConfig
from lmplug.interfaces.quant import QuantMethod
from lmplug.interfaces.quantizer import CalibrationSpec, Quantizer
from lmplug.interfaces.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerLimits,
    SchedulerOptions,
    SchedulerOutput,
)
from lmplug.interfaces.step import StepContext

# family name -> base class; the registry and config use these names.
FAMILIES: dict[str, type] = {
    "attention": AttentionBackend,
    "kvcache": KVCacheBackend,
    "scheduler": Scheduler,
    "quant": QuantMethod,
    "drafter": Drafter,
    "moe": MoEBackend,
    "quantizer": Quantizer,
}

__all__ = [
    "FAMILIES",
    "AttentionBackend",
    "BackendInfo",
    "BackendOptions",
    "CalibrationSpec",
    "Capabilities",
    "DraftProposal",
    "DraftTarget",
    "Drafter",
    "DrafterOptions",
    "KVCacheBackend",
    "KVCacheSpec",
    "KVLayerView",
    "MLAAttentionBackend",
    "MoEBackend",
    "QuantMethod",
    "Quantizer",
    "RoutingConfig",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerOptions",
    "SchedulerOutput",
    "StepContext",
]
