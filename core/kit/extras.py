"""First-party extras a backend may opt into, and a third party never has to implement.

The core's fastest CPU paths need more of a backend than its family's interface: a quant
method that keeps checkpoint blocks packed (GGUF), runs its products on threads of its own,
or hands the native decode step a C function; an attention backend with a native decode or
a leading run of short queries; an adapter backend with a native LoRA product. Each is a mixin here: a backend lists it among its bases and
implements its methods; the core asks through the functions below, which answer "no" for a
backend without the mixin (the Python path, the reference, stays).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from lmplug.interfaces.attention import KVLayerView
    from lmplug.interfaces.step import StepContext
    from lmplug.kit.native import NativeCall


class PackedWeights(ABC):
    """A quant method whose layers may take checkpoint weights still in their packed blocks."""

    @abstractmethod
    def takes_packed(self, device: torch.device) -> bool:
        """True: layers on ``device`` take checkpoint weights still in their packed blocks
        (``lmplug.api.PackedTensor``, from ``ModelSource.iter_packed``) in ``load_shard``, and
        the model routes its token embedding and LM head through this method too (a ``Linear``
        whose rows ``embedding`` looks up), so that no float copy of a packed table is made.
        Such a method must also accept dense tensors (a reader without packed tensors,
        tensor-parallel slices)."""

    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``layer``'s weight ``[out, in]`` as ``[len(ids), in]`` floats: the
        lookup of a token embedding held by this method."""
        return F.embedding(ids, layer.weight)


class OwnThreads(ABC):
    """A quant method whose CPU products run on a thread pool of their own."""

    @abstractmethod
    def own_threads(self, device: torch.device) -> bool:
        """True: on ``device`` (a CPU) this method's products split across
        ``lmplug.kit.threads.compute_threads()`` threads of a pool of its own, not torch's
        intra-op threads; the engine then runs a step of few tokens with torch on one thread
        (``small_ops_single_threaded``), which its small ops run faster on."""


class NativeProduct(ABC):
    """A quant method that hands the native decode step its product as a C function."""

    @abstractmethod
    def native_product(self, layer: torch.nn.Module) -> NativeCall | None:
        """``layer``'s product (``apply``, bias included) as a C function of
        ``lmplug.kit.native.PRODUCT_ABI`` (float32 activations on the CPU), or None: the step
        keeps the Python path. Asked once per layer, after ``process_weights_after_loading``;
        the result must give what ``apply`` gives, to float rounding."""


class NativeDecode(ABC):
    """An attention backend that hands the native decode step its attention as a C function."""

    @abstractmethod
    def native_decode(self, ctx: StepContext, views: list[KVLayerView]) -> NativeCall | None:
        """This step's attention as a C function of ``lmplug.kit.native.ATTENTION_ABI`` (every
        layer of a native decode step calls it; ``views``: the model's cache layers, or a
        drafter's own), or None: the step keeps the Python path. Asked once per step of a float32 model on the
        CPU whose sequences' queries are all short and after cached context: single-token
        decodes, a speculative verify's ``k + 1`` rows or draft tree (``query_masks``), a later
        chunk; at most ``lmplug.kit.native_step.MAX_QUERY_TOKENS`` tokens a sequence. Row t of
        the function's ``qkv`` is the step's query token t; return None for any step it does
        not read. The function must give what ``forward`` gives, to float rounding."""


class NativeLoRA(ABC):
    """An adapter backend that wraps a linear layer's native product with the layer's LoRA update."""

    @abstractmethod
    def native_lora(self, base: NativeCall, lora: object) -> NativeCall | None:
        """A ``PRODUCT_ABI`` function that calls ``base`` and then adds ``b[s] @ (a[s] @ x[t])``
        for each row t whose slot s (``lora.step.native_rows``, the engine's row -> slot map:
        ``lmplug.kit.lora``) is >= 0, over ``lora``'s slots (a ``LinearLoRA``), or None: the
        step keeps the Python path. Asked once per adapted layer when the native decode step is
        planned; the result must give what ``apply`` gives after ``base``, to float rounding."""


class ShortQueries:
    """An attention backend that reads a step's leading run of short queries as decode rows."""

    # the runner orders a step's non-decode queries of at most this many tokens before longer ones
    short_query_tokens: ClassVar[int]


def takes_packed(quant: object, device: torch.device) -> bool:
    return isinstance(quant, PackedWeights) and quant.takes_packed(device)


def own_threads(quant: object, device: torch.device) -> bool:
    return isinstance(quant, OwnThreads) and quant.own_threads(device)


def native_product(quant: object, layer: torch.nn.Module) -> NativeCall | None:
    return quant.native_product(layer) if isinstance(quant, NativeProduct) else None


def native_lora(backend: object, base: NativeCall, lora: object) -> NativeCall | None:
    return backend.native_lora(base, lora) if isinstance(backend, NativeLoRA) else None


def native_decode(backend: object, ctx: StepContext, views: list[KVLayerView]) -> NativeCall | None:
    return backend.native_decode(ctx, views) if isinstance(backend, NativeDecode) else None


def short_query_tokens(backend: object) -> int:
    """0: no leading run of short queries (a backend without ``ShortQueries``)."""
    return backend.short_query_tokens if isinstance(backend, ShortQueries) else 0
