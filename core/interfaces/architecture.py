"""Model architectures: which checkpoints one serves, how it reads them, the module it builds.

An ``Architecture`` is a family like the others (``lmplug_register_architectures``). It says which
HF checkpoints it serves (``config.json``'s ``model_type`` / ``architectures``), parses that config
into the contract's ``ModelConfig`` (the core keeps no list of model types), says what the KV cache
holds per token (``cache_layout``) and builds the model module from the building kit.

The module an architecture builds is a ``torch.nn.Module`` with this protocol (what the engine, the
weight loader and the runner call):

- ``forward(input_ids [T], positions [T], ctx: StepContext) -> hidden [T, h]`` over the step's
  flattened tokens; attention through the attention backend it was built with, reading the cache
  layers bound by ``bind_kv(views: list[KVLayerView])`` (one per cached layer);
- ``compute_logits(hidden [N, h]) -> [N, vocab]``;
- ``weight_target(name) -> (parameter path, shard) | (path, shard, expert) | None`` for every
  checkpoint tensor name (None: not this model's), and ``checkpoint_name(path, shard)``, its inverse,
  for error messages (``lmplug.loading.weights``);
- with state layers (``ModelConfig.has_states``): ``state_specs() -> tuple[StateSpec, ...]`` and
  ``bind_states(views)``.

GGUF files (``GGUF`` feature): the loader chooses the architecture declaring the file's
``general.architecture`` (``gguf_architectures``) before anything is translated, then asks it for
the HF config (``gguf_config``), each tensor's HF name (``gguf_tensor_name``), whether llama.cpp
permuted the Q/K rows (``gguf_permuted``) and what else its converter changed in a tensor's values
(``gguf_values``: Gemma's norm weights stored as ``1 + w``); ``lmplug.interfaces.gguf_header`` has
the standard decoder's translation to call.

``Architecture.fallback``: a backend that can serve checkpoints no native architecture declares (the
``transformers`` fallback); ``auto`` picks it only when no native one serves the checkpoint. The
engine plan resolves the choice once (config key ``model_impl``: ``auto``, ``native``, ``transformers``
or an architecture's name) and logs which architecture serves the checkpoint and why.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from lmplug.errors import ModelLoadError
from lmplug.interfaces.attention import LayerAttention
from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.gguf_header import GGUFHeader, decoder_tensor_name
from lmplug.interfaces.model_config import ModelConfig

# Capabilities.features an architecture may declare (the plan refuses a configuration that needs
# one the chosen architecture lacks, naming it and the option):
TENSOR_PARALLEL = "tensor_parallel"  # builds a rank's shard (parallel.tensor_parallel_size > 1)
GGUF = "gguf"  # reads llama.cpp's GGUF files of ``gguf_architectures``
MTP = "mtp"  # builds a checkpoint's multi-token-prediction layers (``speculative: mtp``)
STATE_LAYERS = "state_layers"  # linear-attention / SSM layers with per-sequence states
MLA = "mla"  # multi-head latent attention (DeepSeek-V2/V3)
PACKED_WEIGHTS = "packed_weights"  # lets a quant method keep GGUF blocks packed (embedding, LM head)
# an encoder (BERT): bidirectional attention over each whole prompt, for embeddings only; the engine
# schedules every prompt in one step, never reuses a cached prefix and refuses generation
ENCODER = "encoder"


@dataclass(frozen=True)
class CacheLayout:
    """What the KV cache holds per token and cached layer (``KVCacheSpec`` fields), and the
    attention softmax scale. MLA caches one latent row per token and layer (``latent``).
    ``layers``: how each cached layer attends where layers differ or need more than a scale and
    the model's window (soft-caps, windows per layer, sinks); the plan refuses an attention
    backend without the features they need (``attention.needed_features``)."""

    num_kv_heads: int
    head_dim: int
    scale: float
    latent: bool = False
    layers: tuple[LayerAttention, ...] = ()
    # per cached layer (num_kv_heads, head_dim) where layers differ (Gemma 4's sliding and full
    # layers); (): every layer has ``num_kv_heads`` x ``head_dim``
    layer_shapes: tuple[tuple[int, int], ...] = ()

    def kv_shape(self) -> dict[str, Any]:
        shape: dict[str, Any] = {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        if self.latent:
            shape["latent"] = True
        if self.layer_shapes:
            shape["layer_shapes"] = self.layer_shapes
        return shape


class Architecture(ABC):
    """One model architecture (one object per engine)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    model_types: ClassVar[tuple[str, ...]] = ()  # config.json ``model_type`` values served
    hf_architectures: ClassVar[tuple[str, ...]] = ()  # config.json ``architectures`` entries served
    gguf_architectures: ClassVar[tuple[str, ...]] = ()  # GGUF ``general.architecture`` values
    # of those, the ones whose Q/K rows llama.cpp's converter permuted (interleaved RoPE in its
    # graph, rotate-half in HF's code: Llama); the loader undoes it
    gguf_permuted: ClassVar[frozenset[str]] = frozenset()
    fallback: ClassVar[bool] = False  # serves what no native architecture declares

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @classmethod
    def serves(cls, hf_config: Mapping[str, Any]) -> str | None:
        """Why this architecture serves a checkpoint with this ``config.json`` (e.g. "model_type
        'llama'"), or None. A fallback answers for what it can build (``cannot_serve``)."""
        model_type = hf_config.get("model_type")
        if model_type in cls.model_types:
            return f"model_type {model_type!r}"
        for name in hf_config.get("architectures") or ():
            if name in cls.hf_architectures:
                return f"architectures {name!r}"
        if cls.fallback and cls.cannot_serve(hf_config) is None:
            return f"fallback for model_type {model_type!r}"
        return None

    @classmethod
    def cannot_serve(cls, hf_config: Mapping[str, Any]) -> str | None:
        """A fallback's reason it cannot build this checkpoint (named in the load error when no
        architecture serves it), None when it can. Native architectures: not asked."""
        return "not a fallback"

    @classmethod
    def gguf_config(cls, header: GGUFHeader) -> dict[str, Any]:
        """The HF ``config.json`` equivalent of a GGUF's metadata (one of ``gguf_architectures``),
        e.g. ``gguf_header.decoder_config`` amended. Errors: ``ModelLoadError`` naming the file."""
        raise ModelLoadError(f"{header.where}: architecture {cls.name!r} reads no GGUF files")

    @classmethod
    def gguf_tensor_name(cls, gguf_name: str, where: str) -> str | None:
        """A GGUF tensor's HF checkpoint name (default: the standard decoder's names); None: a
        tensor that holds settings ``gguf_config`` read from ``GGUFHeader.vectors``, not a weight
        (Phi-3's LongRoPE factors); a name it does not know: ``ModelLoadError`` naming the tensor."""
        return decoder_tensor_name(gguf_name, where)

    @classmethod
    def gguf_values(cls, gguf_name: str, values: Any) -> Any:
        """A dense tensor's values (float32, HF layout) as the HF checkpoint holds them: what
        llama.cpp's converter changed beyond names, dims and the Q/K permutation, undone (Gemma:
        norm weights stored as ``1 + w``). Called on every tensor read dense; 2-D weights a quant
        method keeps packed pass as they are, so only 1-D tensors may change. Default: unchanged."""
        return values

    @abstractmethod
    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        """The checkpoint's ``config.json`` as the contract's ``ModelConfig``; ``where`` (the file)
        is named in every error (``lmplug.errors.ModelLoadError``)."""

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        """What the KV cache stores per token of a cached layer. Default: the config's KV heads and
        head size, softmax scale ``head_dim ** -0.5``; MLA models one latent row."""
        mla = model_config.mla
        if mla is not None:
            return CacheLayout(1, mla.latent_dim, mla.softmax_scale, latent=True)
        return CacheLayout(model_config.num_kv_heads, model_config.head_dim, model_config.head_dim ** -0.5)

    @abstractmethod
    def build(self, model_config: ModelConfig, *, dtype: Any, quant: Any, attention: Any,
              max_model_len: int, parallel: Any, moe: Any = None, mixer: Any = None) -> Any:
        """The model module (the protocol above), with empty weights on the current default
        device: ``quant`` (a ``QuantMethod``) holds its linear layers, ``attention`` (an
        ``AttentionBackend``) computes its attention, ``parallel`` is this rank's
        ``ParallelState``; ``moe`` / ``mixer`` the backends of MoE and state layers, when the model
        has them. The weights are loaded afterwards through ``weight_target``."""
