"""The contract: everything a plugin may use of the core, and nothing above it.

One small ABC per extension point (the families, ``families.TABLE``), the records they share
(capabilities, options, the per-step record, the sequence view, sampling parameters and
primitives, model facts, the checkpoint reader's output) and shared math (RoPE, slot
addresses, draft-tree shapes). This package imports nothing from ``lmplug.engine``,
``models``, ``loading``, ``config`` or ``parallel`` (import-linter holds it).
"""

from lmplug.interfaces.acceptance import AcceptanceOptions, AcceptanceRule, Decision
from lmplug.interfaces.attention import (
    AttentionBackend,
    KVLayerView,
    LayerAttention,
    MLAAttentionBackend,
)
from lmplug.interfaces.checkpoint import ModelSource
from lmplug.interfaces.common import BackendInfo, BackendOptions, Capabilities
from lmplug.interfaces.compressor import (
    CompressionInput,
    CompressionParams,
    CompressionResult,
    Compressor,
    CompressorOptions,
    Scorer,
    Segment,
)
from lmplug.interfaces.drafter import (
    Drafter,
    DrafterOptions,
    DraftModel,
    DraftProposal,
    DraftTarget,
    MTPDraft,
)
from lmplug.interfaces.families import TABLE as FAMILY_TABLE
from lmplug.interfaces.families import Family
from lmplug.interfaces.kv_layout import kv_slots, kv_slots_list
from lmplug.interfaces.kvcache import KVCacheBackend, KVCacheSpec
from lmplug.interfaces.kvconnector import KVBlockFormat, KVConnector
from lmplug.interfaces.mixer import MixerBackend
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.moe import MoEBackend, RoutingConfig
from lmplug.interfaces.native import NativeCall
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.paths import cache_dir
from lmplug.interfaces.quant import QuantMethod, Unquantized
from lmplug.interfaces.quantizer import CalibrationSpec, Quantizer
from lmplug.interfaces.rope import RotaryEmbedding
from lmplug.interfaces.runner import ForwardRunner, StepResult
from lmplug.interfaces.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerLimits,
    SchedulerOptions,
    SchedulerOutput,
)
from lmplug.interfaces.sequence import Logprob, Sequence, SequenceStatus
from lmplug.interfaces.state import StatePool, StateSpec, StateTensor
from lmplug.interfaces.step import StepContext
from lmplug.interfaces.training import TrainingHost, TrainingTarget

# family name -> base class; the registry and config use these names (from the one table).
FAMILIES: dict[str, type] = {f.name: f.base for f in FAMILY_TABLE}

__all__ = [
    "FAMILIES",
    "FAMILY_TABLE",
    "AcceptanceOptions",
    "AcceptanceRule",
    "AttentionBackend",
    "BackendInfo",
    "BackendOptions",
    "CalibrationSpec",
    "Capabilities",
    "CompressionInput",
    "CompressionParams",
    "CompressionResult",
    "Compressor",
    "CompressorOptions",
    "Decision",
    "DraftModel",
    "DraftProposal",
    "DraftTarget",
    "Drafter",
    "DrafterOptions",
    "Family",
    "ForwardRunner",
    "KVBlockFormat",
    "KVCacheBackend",
    "KVCacheSpec",
    "KVConnector",
    "KVLayerView",
    "LayerAttention",
    "Logprob",
    "MLAAttentionBackend",
    "MTPDraft",
    "MixerBackend",
    "MoEBackend",
    "ModelConfig",
    "ModelSource",
    "NativeCall",
    "QuantMethod",
    "Quantizer",
    "RotaryEmbedding",
    "RoutingConfig",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerOptions",
    "SchedulerOutput",
    "Scorer",
    "Segment",
    "Sequence",
    "SequenceStatus",
    "StatePool",
    "StateSpec",
    "StateTensor",
    "StepContext",
    "StepResult",
    "TrainingHost",
    "TrainingTarget",
    "Unquantized",
    "cache_dir",
    "kv_slots",
    "kv_slots_list",
]
