"""Attention backends: compute attention for one layer over the step's tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.step import StepContext

# Capabilities.features of attention backends that a model's per-layer attention may need
# (``LayerAttention``; the engine plan refuses a backend that lacks one, naming the feature):
SLIDING_WINDOW = "sliding_window"  # one window, the same in every layer
LAYER_WINDOWS = "layer_windows"  # a window per layer, some layers none (Gemma 2/3, GPT-OSS)
LAYER_SCALES = "layer_scales"  # a softmax scale per layer, not the same in every layer
LOGIT_SOFTCAP = "logit_softcap"  # scores soft-capped: cap * tanh(scores / cap) (Gemma 2)
ATTENTION_SINKS = "attention_sinks"  # a learned per-head logit in the softmax denominator (GPT-OSS)


@dataclass(frozen=True)
class LayerAttention:
    """How one cached layer attends: its softmax scale, its sliding window (None: none; a key
    at position k is seen from position p when p - window < k <= p), its score soft-cap (None:
    none) and whether it has attention sinks. An architecture declares one per cached layer
    (``CacheLayout.layers``); a backend reads its layer's with ``layer_attention(layer)``."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False


def needed_features(layers: Sequence[LayerAttention]) -> dict[str, str]:
    """The attention features these layers need, each with what needs it (for the plan's error)."""
    needs: dict[str, str] = {}
    windows = {spec.sliding_window for spec in layers}
    if len(windows) > 1:
        needs[LAYER_WINDOWS] = f"sliding windows per layer ({sorted(map(str, windows))})"
    elif windows - {None}:
        needs[SLIDING_WINDOW] = f"a sliding window of {next(iter(windows))}"
    if len({spec.scale for spec in layers}) > 1:
        needs[LAYER_SCALES] = "a softmax scale per layer"
    caps = sorted({spec.softcap for spec in layers} - {None})
    if caps:
        needs[LOGIT_SOFTCAP] = f"attention-logit soft-capping at {', '.join(map(str, caps))}"
    if any(spec.sinks for spec in layers):
        needs[ATTENTION_SINKS] = "attention sinks"
    return needs


class AttentionBackend(ABC):
    """One object per engine, shared by all layers.

    ``forward`` writes the new K/V of this step into the cache (at
    ``ctx.slot_mapping``) and returns attention over the whole context of each
    sequence: everything cached before this step plus the new tokens, causal.

    Per-step metadata: what a backend derives from the ``StepContext`` alone (gather
    indices, masks, host-side maxima, kernel tables) is built once per step, not once per
    layer. The backend builds it in ``prepare``, as its own typed object (a dataclass);
    ``forward`` asks for it with ``ctx.metadata_for(self, kv)``, which calls ``prepare`` on
    the first layer's call and hands every later layer the same object.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    def __init__(self, options: BackendOptions, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, sliding_window: int | None = None,
                 layers: Sequence[LayerAttention] = ()) -> None:
        """``layers``: each cached layer's ``LayerAttention`` where the model declares them (the
        plan checked this backend has the features they need); (): every layer attends with
        ``scale`` and ``sliding_window``."""
        self.options = options
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.layers = tuple(layers)
        self._uniform = LayerAttention(scale, sliding_window)
        self._all_uniform = all(spec == self._uniform for spec in self.layers)

    def layer_attention(self, layer: int) -> LayerAttention:
        """How cache layer ``layer`` attends (its scale, window, soft-cap, sinks)."""
        return self.layers[layer] if self.layers else self._uniform

    @property
    def uniform_layers(self) -> bool:
        """Every layer attends with ``scale`` and ``sliding_window``, no soft-cap, no sinks."""
        return self._all_uniform

    @classmethod
    def features_for(cls, options: BackendOptions, device: str) -> frozenset[str]:
        """The features these options give on ``device`` ("cpu", "cuda"): ``capabilities.features``
        unless some depend on the options (e.g. a kernel choice without tree masks)."""
        return cls.capabilities.features

    @classmethod
    def check_target(cls, options: BackendOptions, kv_dtype: str, head_dim: int, dtype: str,
                     capability: tuple[int, int] | None) -> None:
        """Refuse, when the config is loaded, a configuration this backend's kernels cannot build
        or run on the CUDA GPU of compute ``capability`` (``lmplug.kit.devices``), rather
        than failing to compile on the first step: raise ``lmplug.errors.ConfigError`` naming the
        config key, the backend and the GPU (``devices.describe(capability)``). ``kv_dtype`` is
        what the KV cache stores ("auto": the model dtype, or e.g. "int8", "fp8_e4m3"),
        ``head_dim`` the width of a cached K/V row per head, ``dtype`` the model dtype
        ("float16", ...). Called by the engine plan for device "cuda" only. Default: no limits."""

    def prepare(self, ctx: StepContext, kv: KVLayerView) -> object | None:
        """This step's metadata, built once per step by ``ctx.metadata_for(self, kv)``.

        Contract: read only ``ctx`` and the format of ``kv`` (its device, dtype, quantization
        and pool shape, which every layer of a model shares; never the cache contents, which
        each layer's forward changes), do not modify either, and return a new object that
        ``forward`` only reads. The default builds nothing.
        """
        return None

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (the step's new tokens). Returns [T, H, D].

        A backend that lists ``ATTENTION_SINKS`` also takes the keyword ``sinks``: a float tensor
        [H] of learned logits, one per query head, joined to each row's softmax denominator
        (``exp(sinks[h])`` added to the sum, with no value: GPT-OSS). Models pass it only for
        layers whose ``LayerAttention.sinks`` is true; the plan refuses a backend without it."""


class MLAAttentionBackend(AttentionBackend):
    """Attention for multi-head latent attention models (DeepSeek-V2/V3); lists the "mla" feature.

    Built with ``num_kv_heads=1`` and ``head_dim = kv_lora_rank + rope dims``: the KV cache holds,
    per token and layer, one row ``[latent | k_pe]`` shared by all heads, in ``kv.k_cache``
    (``kv.v_cache`` is empty: the latent layout stores no V). The model calls ``forward_mla``
    instead of ``forward`` and hands over the layer's ``kv_b_proj`` split per head, so a backend
    can expand the latent to per-head K/V (prefill) or fold the matrices into the query and the
    output and attend over the latent itself (the absorbed decode).
    """

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        raise TypeError(f"attention backend {self.name!r} serves MLA models only; they call forward_mla")

    @abstractmethod
    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                    k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, kv: KVLayerView,
                    ctx: StepContext) -> torch.Tensor:
        """Write ``[latent | k_pe]`` of the step's tokens at ``ctx.slot_mapping``, attend causally.

        q_nope: [T, H, nope]; q_pe: [T, H, rope] (RoPE applied); latent: [T, R] (after
        kv_a_layernorm); k_pe: [T, rope] (RoPE applied); w_uk: [H, nope, R] and w_uv: [H, V, R],
        ``kv_b_proj.weight`` viewed per head (key rows, then value rows). Per head h the keys
        are ``[latent @ w_uk[h].T | k_pe]`` and the values ``latent @ w_uv[h].T``; the softmax
        scale is ``self.scale``. Returns [T, H, V].
        """


class KVLayerView:
    """One layer's K and V storage, as the KV backend hands it to attention.

    ``k_cache`` / ``v_cache``: [num_blocks, block_size, Hkv, D]. Slot ``s`` is
    block ``s // block_size``, offset ``s % block_size``; a sequence's blocks
    are listed in ``StepContext.block_tables`` (position to slot:
    ``lmplug.kit.kv_layout.kv_slots``). The contiguous layout is the
    special case of one block of ``max_model_len`` slots per sequence.

    Quantized KV (kvcache ``dtype: int8 | fp8_e4m3``): the caches hold int8 /
    float8_e4m3fn and ``k_scale`` / ``v_scale`` [num_blocks, block_size, Hkv]
    float32 hold one scale per (slot, KV head); value = ``cache * scale``
    (``lmplug.interfaces.kvcache.dequantize_kv``). ``None`` when unquantized.
    """

    __slots__ = ("k_cache", "k_scale", "layout", "v_cache", "v_scale")

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.layout = layout
        self.k_scale = k_scale
        self.v_scale = v_scale

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]
