"""Quantization methods: create, load, post-process and apply a linear layer's weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from lmplug.interfaces.common import BackendOptions, Capabilities


class QuantMethod(ABC):
    """One object per engine; it decides per linear layer and owns that layer's math.

    ``create_weights`` registers parameters on ``layer`` (a ``torch.nn.Module``),
    the loader copies checkpoint tensors into them by name,
    ``process_weights_after_loading`` repacks once, and ``apply`` computes
    ``y = x W^T (+ b)``. The same object can quantize offline.

    A fused layer (q/k/v, gate/up) concatenates several checkpoint tensors
    along its *output* features; the loader hands each one to ``load_shard``
    with the shard's output offset and size. Where a tensor keeps its output
    axis, and how many output features one stored element packs, is the
    method's business (``shard_layout``): the loader knows no format.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @classmethod
    def from_checkpoint_config(cls, quantization_config: dict) -> BackendOptions:
        """Options from a checkpoint's ``quantization_config``."""
        return cls.Options(**{k: v for k, v in quantization_config.items() if k in cls.Options.model_fields})

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype, bias: bool) -> None: ...

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def method_for_layer(self, prefixes: list[str]) -> QuantMethod:
        """The method that runs one linear layer, given the checkpoint prefix of each of its
        shards (e.g. ``model.layers.0.self_attn.q_proj``; one per fused piece). Called once per
        layer after the model is built and before loading; a method other than ``self`` (e.g.
        ``Unquantized()`` for a layer the checkpoint leaves in float, or one scheme of a mixed
        checkpoint) replaces this one for that layer and creates its weights afresh.
        Default: ``self`` for every layer."""
        return self

    def shard_layout(self, layer: torch.nn.Module, param_name: str) -> tuple[int, int] | None:
        """``(axis, pack)``: the axis of parameter ``param_name`` along which output features lie
        and how many output features one element on that axis holds (1: unpacked). None: the
        tensor has no output axis (e.g. GPTQ's ``g_idx``); every shard carries all of it and
        the shards must agree. Default: output features are rows (``weight [out, in]``, ``bias``)."""
        return 0, 1

    def input_layout(self, layer: torch.nn.Module, param_name: str) -> tuple[int, int] | None:
        """Tensor parallelism, row-parallel layers (o, down): ``(axis, pack)``, the axis of
        ``param_name`` along which *input* features lie and how many input features one element
        on it covers (a packed word, or a group for per-group scales). The loader reads input
        features ``[layer.input_start, layer.input_start + layer.in_features)`` of the checkpoint's
        ``layer.full_in_features``. None: every rank reads the tensor whole (the bias is handled by
        the loader). Default: the dense ``weight [out, in]``."""
        return (1, 1) if param_name == "weight" else None

    def load_shard(self, layer: torch.nn.Module, param_name: str, tensor: torch.Tensor,
                   shard_offset: int, shard_size: int) -> None:
        """Copy checkpoint ``tensor`` into the slice of ``layer.<param_name>`` that holds output
        features ``[shard_offset, shard_offset + shard_size)``. Raises ``ValueError`` with a
        sentence saying what does not fit; the loader adds the file and tensor name."""
        param = getattr(layer, param_name).data
        layout = self.shard_layout(layer, param_name)
        if layout is None:
            _load_replicated(layer, param_name, param, tensor)
            return
        axis, pack = layout
        if shard_offset % pack or shard_size % pack:
            raise ValueError(f"covers output features [{shard_offset}, {shard_offset + shard_size}), "
                             f"which do not split into whole packed elements of {pack} features")
        dest = param.narrow(axis, shard_offset // pack, shard_size // pack)
        _check_shape(dest, tensor)
        dest.copy_(tensor)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded tensors once (default: nothing to do)."""


def _check_shape(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}")


def _load_replicated(layer: torch.nn.Module, name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    _check_shape(param, tensor)
    loaded = layer.__dict__.setdefault("_lmplug_replicated_loaded", set())
    if name in loaded and not torch.equal(param, tensor.to(param.dtype)):
        raise ValueError(f"differs from the {name!r} of another shard of the same fused layer; "
                         "the shards must carry the same tensor")
    param.copy_(tensor)
    loaded.add(name)


class Unquantized(QuantMethod):
    """Plain dense weights: ``y = x W^T + b``. The core's default, not a plugin."""

    name = "none"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))

    def __init__(self, options: BackendOptions | None = None) -> None:
        super().__init__(options or BackendOptions())

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                      if bias else None)

    def process_weights_after_loading(self, layer) -> None:
        """On CPU keep a float32 W^T contiguous (same values and shape, column-major strides):
        the BLAS GEMM of a few rows (a speculative verify of k+1 tokens, a small batch) then
        runs 1.3-2x faster than on a row-major W (benchmarks/bench_speculative.py). bfloat16
        stays row-major: oneDNN's bf16 GEMM is 10-20% slower on the transposed layout."""
        weight = layer.weight
        if weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.float32:
            layer.weight.data = layer.weight.data.t().contiguous().t()

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)
