"""KV storage: owns the cache tensors (storage side) and counts slots (accounting side).

Quantized KV (``kvcache: {dtype: int8 | fp8_e4m3}``): each (token, KV head) vector of
``head_dim`` values is stored as int8 / float8_e4m3fn with one float32 scale, kept in a
parallel scale tensor of the same layout without the last dim. Symmetric and dynamic
(no calibration): ``scale = amax / QMAX`` (127 for int8, 448 for e4m3, its largest
finite value); ``x ~= q * scale``. ``lmplug.kit.kv_quant`` holds the one definition every
backend writes and reads with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from lmplug.errors import ConfigError
from lmplug.interfaces.attention import KVLayerView
from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.state import StateSpec, state_bytes

if TYPE_CHECKING:
    from lmplug.interfaces.sequence import Sequence


# kvcache `dtype:` option -> storage dtype ("auto": the model dtype, no scales)
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
@dataclass(frozen=True)
class KVCacheSpec:
    """What the model needs stored per token and layer, and the engine's limits."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    # attention sees only the last `sliding_window` keys; backends listing the
    # "sliding_window" feature release what falls out of it
    sliding_window: int | None = None
    # the most new tokens one step writes per sequence (the scheduler's token budget)
    max_num_batched_tokens: int | None = None
    # MLA: one "K" row per token and layer (num_kv_heads=1, head_dim = kv_lora_rank + rope dims)
    # holds the latent and the shared RoPE key; there is no V, and backends allocate none
    latent: bool = False
    # the kvcache backend's `dtype` option: "auto" stores ``dtype``; "int8" / "fp8_e4m3" store
    # one byte per value plus a float32 scale per (token, KV head) (see quantize_kv)
    kv_dtype: str = "auto"
    # linear-attention / SSM layers: one fixed-size state per sequence and layer, in state-layer
    # order (``lmplug.interfaces.state``); ``num_layers`` then counts the softmax layers only.
    # Backends listing the "state" feature keep them in a ``StatePool`` beside the K/V
    states: tuple[StateSpec, ...] = ()
    # each cached layer's sliding window where the model's layers differ (``LayerAttention``;
    # Gemma 2/3, GPT-OSS), () otherwise: what the paged cache accounts per layer group
    layer_windows: tuple[int | None, ...] = ()
    # per cached layer (num_kv_heads, head_dim) where layers differ (Gemma 4: sliding layers of
    # ``head_dim``, full ones of ``global_head_dim`` and other KV heads); (): every layer is
    # ``num_kv_heads`` x ``head_dim``. Backends store each layer at its own shape
    layer_shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.layer_shapes and len(self.layer_shapes) != self.num_layers:
            raise ValueError(f"KVCacheSpec: layer_shapes lists {len(self.layer_shapes)} layers, "
                             f"num_layers is {self.num_layers}")

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """(num_kv_heads, head_dim) of cached layer ``layer``."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    @property
    def shape_groups(self) -> dict[tuple[int, int], list[int]]:
        """The cached layers by (num_kv_heads, head_dim), in first-seen order: one group unless
        layers differ."""
        groups: dict[tuple[int, int], list[int]] = {}
        for layer in range(self.num_layers):
            groups.setdefault(self.layer_shape(layer), []).append(layer)
        return groups

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of one sequence's state over every state layer (0 without state layers)."""
        return state_bytes(self.states)

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the K/V tensors hold: the model dtype, or the quantized storage dtype."""
        return KV_CACHE_DTYPES.get(self.kv_dtype, self.dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in KV_CACHE_DTYPES

    def with_kv_dtype(self, kv_dtype: str, backend: str) -> KVCacheSpec:
        """This spec storing ``kv_dtype`` (a kvcache backend's `dtype` option)."""
        if kv_dtype != "auto" and kv_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kvcache: {backend}: dtype must be auto, {', '.join(KV_CACHE_DTYPES)}; "
                              f"got {kv_dtype!r}")
        if kv_dtype != "auto" and self.latent:
            raise ConfigError(f"kvcache: {backend}: dtype={kv_dtype!r} is not supported for the MLA "
                              "latent cache (attention: mla reads the model dtype only); use dtype: auto")
        return replace(self, kv_dtype=kv_dtype)

    @property
    def num_kv_tensors(self) -> int:
        """Tensors stored per layer: K and V, or the latent alone."""
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V (or latent): tensors x the sum over layers of kv_heads x (head_dim
        x dtype bytes, plus a 4-byte scale when quantized)."""
        return sum(map(self.layer_bytes_per_token, range(self.num_layers)))

    def layer_bytes_per_token(self, layer: int) -> int:
        """One cached layer's share of ``bytes_per_token`` (at its own shape, ``layer_shape``)."""
        item = torch.empty((), dtype=self.cache_dtype).element_size()
        heads, dim = self.layer_shape(layer)
        return self.num_kv_tensors * heads * (dim * item + (4 if self.quantized else 0))


class KVCacheBackend(ABC):
    """The scheduler talks to the accounting methods; attention reads ``layer_view``.

    The scheduler never touches tensors; the runner asks ``block_table(seq)``
    to build slot mappings. Slots of a sequence are ``block_table[i] *
    block_size + offset``. Eight abstract methods are the whole of what a KV cache must
    implement; forking, swap space, a connector's tier, tensor-parallel copies, state slots,
    a pool sized at construction and prefix sharing are opt-in mixins of the kit
    (``lmplug.kit.kv_extras``), each paired with the feature it implements.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions, spec: KVCacheSpec) -> None:
        self.options = options
        self.spec = spec

    # -- what the core asks of the options, before and across instances -------------
    @classmethod
    def kv_dtype_of(cls, options: BackendOptions) -> str:
        """The K/V storage these options choose: "auto" (the model dtype, the default) or a
        ``KV_CACHE_DTYPES`` name; the config checks the attention backend reads it."""
        return "auto"

    # -- layout ---------------------------------------------------------------
    @property
    @abstractmethod
    def layout(self) -> str:
        """The layout attention must read: "contiguous", "paged" or "latent"."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Slots per block (for contiguous: ``max_model_len``, one block per sequence)."""

    @abstractmethod
    def layer_view(self, layer: int) -> KVLayerView:
        """The cache tensors of one layer."""

    # -- accounting -------------------------------------------------------------
    @abstractmethod
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` could grow to hold ``num_tokens`` tokens in total."""

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Grow ``seq``'s storage to hold ``num_tokens`` tokens.

        Returns how many leading tokens already have their K/V stored (a prefix
        cache hit on first allocation; 0 for backends without prefix caching).
        A hit never covers the last token, whose logits must be computed.
        """

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Return everything ``seq`` holds. Freeing an unknown sequence is a no-op."""

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep storage for ``seq``'s first ``num_tokens`` tokens only (speculative decoding:
        the K/V past them belong to rejected draft tokens).

        Backends that hand out storage per block release blocks wholly past ``num_tokens``;
        those slots were never computed for accepted tokens, so they must not enter a prefix
        cache. The default keeps everything: stale slots are overwritten when the sequence
        computes those positions again (the contiguous layout).
        """

    @abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """Block ids of ``seq`` in order."""

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""

    def close(self) -> None:
        """Release what outlives the engine (a connector's pending writes); called at shutdown."""

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token
