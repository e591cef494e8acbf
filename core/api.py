"""The plugin API (``lmplug.api``): the one module a third-party plugin imports, versioned.

Everything a backend of any family implements or receives: the family base classes and their
options, ``Capabilities``, the per-step record and KV-layer views, ``SamplingParams``, the
sequence, the model's facts, the checkpoint reader's record, the errors and ``hookimpl``.
``__all__`` is the whole API (a test holds that no public name is bound here without being in
it): a name in it stays, with its meaning, for every core release of the same
``API_VERSION``; removing or changing one bumps the version, and the plugin manager then
refuses plugins written for the old one with a clear error. Helpers to build backends with
(sampling, RoPE, KV quantization, native builds, layers) are the kit, ``lmplug.kit``,
versioned on its own terms. The definitions live in ``lmplug.interfaces`` (the API's
modules; plugins import them from here).
"""

from lmplug.errors import ConfigError, LmplugError, ModelLoadError, PluginError
from lmplug.hookspecs import hookimpl
from lmplug.interfaces.acceptance import LOSSY, AcceptanceOptions, AcceptanceRule, Decision
from lmplug.interfaces.architecture import (
    GGUF,
    MLA,
    MTP,
    PACKED_WEIGHTS,
    STATE_LAYERS,
    TENSOR_PARALLEL,
    Architecture,
    CacheLayout,
)
from lmplug.interfaces.attention import AttentionBackend, KVLayerView, MLAAttentionBackend
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
    fit_drop,
)
from lmplug.interfaces.config_fields import ConfigReader
from lmplug.interfaces.constraint import (
    ConstraintBackend,
    ConstraintError,
    ConstraintOptions,
    ConstraintTokenizer,
    Matcher,
    StructuredOutput,
    bitmask_words,
)
from lmplug.interfaces.drafter import (
    Drafter,
    DrafterOptions,
    DraftModel,
    DraftProposal,
    DraftTarget,
    MTPDraft,
)
from lmplug.interfaces.engine_view import EngineView
from lmplug.interfaces.kvcache import KVCacheBackend, KVCacheSpec
from lmplug.interfaces.kvconnector import KVBlockFormat, KVConnector
from lmplug.interfaces.mixer import MixerBackend
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.moe import MoEBackend, RoutingConfig
from lmplug.interfaces.packed import BLOCK_SIZES, PackedTensor
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.quant import QuantMethod, Unquantized
from lmplug.interfaces.quantizer import CalibrationSpec, Progress, Quantizer
from lmplug.interfaces.runner import ForwardRunner, StepResult
from lmplug.interfaces.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerLimits,
    SchedulerOptions,
    SchedulerOutput,
)
from lmplug.interfaces.sequence import Logprob, Sequence, SequenceStatus, SequenceView
from lmplug.interfaces.state import (
    ATTENTION,
    GATED_DELTA,
    LIGHTNING,
    MAMBA2,
    StatePool,
    StateSpec,
    StateTensor,
    cache_indices,
)
from lmplug.interfaces.step import StepContext
from lmplug.interfaces.training import TrainingHost, TrainingTarget

# The API's major version: a plugin declares the one it targets (``LMPLUG_API_VERSION``).
# 2: plugins import only the contract; 3: the model family, the kit (``lmplug.kit``) and this
# module, the API's one import.
API_VERSION = 3

__all__ = [
    "API_VERSION",
    "ATTENTION",
    "BLOCK_SIZES",
    "GATED_DELTA",
    "GGUF",
    "LIGHTNING",
    "LOSSY",
    "MAMBA2",
    "MLA",
    "MTP",
    "PACKED_WEIGHTS",
    "STATE_LAYERS",
    "TENSOR_PARALLEL",
    "AcceptanceOptions",
    "AcceptanceRule",
    "Architecture",
    "AttentionBackend",
    "BackendInfo",
    "BackendOptions",
    "CacheLayout",
    "CalibrationSpec",
    "Capabilities",
    "CompressionInput",
    "CompressionParams",
    "CompressionResult",
    "Compressor",
    "CompressorOptions",
    "ConfigError",
    "ConfigReader",
    "ConstraintBackend",
    "ConstraintError",
    "ConstraintOptions",
    "ConstraintTokenizer",
    "Decision",
    "DraftModel",
    "DraftProposal",
    "DraftTarget",
    "Drafter",
    "DrafterOptions",
    "EngineView",
    "ForwardRunner",
    "KVBlockFormat",
    "KVCacheBackend",
    "KVCacheSpec",
    "KVConnector",
    "KVLayerView",
    "LmplugError",
    "Logprob",
    "MLAAttentionBackend",
    "MTPDraft",
    "Matcher",
    "MixerBackend",
    "MoEBackend",
    "ModelConfig",
    "ModelLoadError",
    "ModelSource",
    "PackedTensor",
    "PluginError",
    "Progress",
    "QuantMethod",
    "Quantizer",
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
    "SequenceView",
    "StatePool",
    "StateSpec",
    "StateTensor",
    "StepContext",
    "StepResult",
    "StructuredOutput",
    "TrainingHost",
    "TrainingTarget",
    "Unquantized",
    "bitmask_words",
    "cache_indices",
    "fit_drop",
    "hookimpl",
]
