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
from lmplug.interfaces.adapter import AdapterBackend, AdapterOptions, LoRARequest
from lmplug.interfaces.architecture import (
    ENCODER,
    GGUF,
    MLA,
    MTP,
    PACKED_WEIGHTS,
    STATE_LAYERS,
    TENSOR_PARALLEL,
    Architecture,
    CacheLayout,
)
from lmplug.interfaces.attention import (
    ATTENTION_SINKS,
    LAYER_SCALES,
    LAYER_WINDOWS,
    LOGIT_SOFTCAP,
    SLIDING_WINDOW,
    AttentionBackend,
    KVLayerView,
    LayerAttention,
    MLAAttentionBackend,
    needed_features,
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
    fit_drop,
)
from lmplug.interfaces.config_fields import ConfigReader, check_depth
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
from lmplug.interfaces.gguf_header import GGUFHeader, decoder_config, decoder_tensor_name
from lmplug.interfaces.kvcache import KVCacheBackend, KVCacheSpec
from lmplug.interfaces.kvconnector import KVBlockFormat, KVConnector
from lmplug.interfaces.layer_types import hybrid_layer_types, mamba2_fields
from lmplug.interfaces.mixer import MixerBackend
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.moe import MoEBackend, RoutingConfig
from lmplug.interfaces.moe_config import deepseek_moe, mixtral_moe, qwen_moe
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
    "ATTENTION_SINKS",
    "BLOCK_SIZES",
    "ENCODER",
    "GATED_DELTA",
    "GGUF",
    "LAYER_SCALES",
    "LAYER_WINDOWS",
    "LIGHTNING",
    "LOGIT_SOFTCAP",
    "LOSSY",
    "MAMBA2",
    "MLA",
    "MTP",
    "PACKED_WEIGHTS",
    "SLIDING_WINDOW",
    "STATE_LAYERS",
    "TENSOR_PARALLEL",
    "AcceptanceOptions",
    "AcceptanceRule",
    "AdapterBackend",
    "AdapterOptions",
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
    "GGUFHeader",
    "KVBlockFormat",
    "KVCacheBackend",
    "KVCacheSpec",
    "KVConnector",
    "KVLayerView",
    "LayerAttention",
    "LmplugError",
    "LoRARequest",
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
    "check_depth",
    "decoder_config",
    "decoder_tensor_name",
    "deepseek_moe",
    "fit_drop",
    "hookimpl",
    "hybrid_layer_types",
    "mamba2_fields",
    "mixtral_moe",
    "needed_features",
    "qwen_moe",
]
