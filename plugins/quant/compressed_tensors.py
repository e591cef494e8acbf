"""compressed-tensors checkpoints (``quant_method: compressed-tensors``; llm-compressor's output).

config.json's ``quantization_config`` holds ``config_groups``: each group
``targets`` layers (``"Linear"``: every linear layer; ``"re:<regex>"``:
checkpoint names the regex matches from their start; else an exact name or
name suffix) and says how their ``weights`` and ``input_activations`` are
quantized (``num_bits``, ``type`` int | float, ``symmetric``, ``strategy``,
``group_size``, ``block_structure``, ``dynamic``). Layers matching ``ignore``
(same rules) or no group stay in float. Each layer gets the scheme of its
group (``method_for_layer``); a fused layer's pieces must agree.

Schemes read (FORMATS.md "FP8"):

- float-quantized fp8 (``type: float``, 8 bits): ``weight`` fp8 ``[out, in]``,
  ``weight_scale`` per tensor ``[1]``, per channel ``[out, 1]`` or per block
  ``[ceil(out/bn), ceil(in/bk)]``; activations dynamic per token, per tensor or
  per group, static per tensor (``input_scale``), or none (weight-only);
- int-quantized int8 (symmetric): ``weight`` int8 ``[out, in]``, ``weight_scale``
  per channel or tensor; activations int8 per token (dynamic) or static per
  tensor - SmoothQuant W8A8 - or none;
- pack-quantized int4/int8 weights only: ``weight_packed`` int32 ``[out, in * bits
  / 32]`` (values along the input, value ``j`` of a word at bit ``j * bits``,
  stored ``+ 2**(bits-1)``), ``weight_scale [out, in / group]`` (or ``[out, 1]``
  per channel), ``weight_shape [2]``; run as W4A16 (``w4a16_kernels`` on CUDA).

Anything else (3-bit, asymmetric, act-order, sparse formats) is a clear
ModelLoadError when the config is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lmplug_quant.common import (
    PackedMethod,
    check_divisible,
    check_group_size,
    float_param,
    int_param,
    make_bias,
)
from lmplug_quant.packing import pack_cols, unpack_cols, values_per_word
from lmplug_quant.w8a8_common import W8A8_CAPABILITIES, W8A8Linear, W8A8Options, W8A8Scheme
from pydantic import Field, model_validator

from lmplug.api import QuantMethod, Unquantized
from lmplug.errors import ModelLoadError

METHOD = "compressed-tensors"


@dataclass(frozen=True)
class PackScheme:
    """pack-quantized weight-only int: ``bits`` and input features per scale (0: per channel)."""

    bits: int
    group_size: int


class CompressedTensorsOptions(W8A8Options):
    kernel: Literal["auto", "triton", "torch"] = Field(
        default="auto", description="triton: the scaled 8-bit GEMM for W8A8 layers (fp8 needs compute "
        "capability 8.9+), the W4A16 GEMM for pack-quantized ones; torch: int8 through torch._int_mm "
        "on CPU, else dequantized weights; auto: triton on CUDA where it runs, else torch")
    dequantize_at_load: bool | None = Field(
        default=None, description="torch path: keep a dequantized weight after loading (W8A8 "
        "activations are still quantized); default: yes unless a kernel reads the quantized one")
    format: str | None = Field(default=None, description="the checkpoint's format (float-quantized, "
                               "int-quantized, pack-quantized, naive-quantized); a group may name its own")
    config_groups: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="the quantization_config's groups: targets and schemes")
    ignore: list[str] = Field(default_factory=list, description="layers left in float "
                              "(names, or `re:` regexes, matched against checkpoint names)")
    sparsity_config: dict[str, Any] | None = Field(default=None, description="must be dense (or absent)")

    @model_validator(mode="after")
    def _readable(self):
        sparse = (self.sparsity_config or {}).get("format")
        if sparse not in (None, "dense"):
            raise ValueError(f"sparsity_config format {sparse!r} is not supported (dense only)")
        for name, group in self.config_groups.items():
            parse_group(name, group, self.format)
        return self


def parse_group(name: str, group: dict, default_format: str | None) -> W8A8Scheme | PackScheme:
    """One config group -> its scheme; ValueError naming the group and field it cannot run."""
    where = f"config_groups.{name}"
    fmt = group.get("format") or default_format
    w, a = group.get("weights"), group.get("input_activations")
    if not isinstance(group.get("targets"), list) or not group["targets"]:
        raise ValueError(f"{where}.targets must list the layers it quantizes")
    if not isinstance(w, dict):
        raise ValueError(f"{where}.weights is missing (activation-only quantization is not supported)")  # noqa: TRY004
    bits, wtype, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")

    def bad(field: str, value, supported: str) -> ValueError:
        return ValueError(f"{where}.{field} = {value!r} is not supported ({supported})")

    if w.get("dynamic"):
        raise bad("weights.dynamic", True, "weights are quantized offline")
    if not w.get("symmetric", True):
        raise bad("weights.symmetric", False, "symmetric weights only")
    if w.get("actorder") not in (None, False, "static"):
        raise bad("weights.actorder", w.get("actorder"), "no activation reordering")
    if fmt == "pack-quantized":
        if wtype != "int" or bits not in (4, 8):
            raise bad("weights.num_bits", bits, "pack-quantized: int, 4 or 8 bits")
        if a is not None:
            raise bad("input_activations", a, "pack-quantized runs weight-only (W4A16/W8A16)")
        if strategy == "group":
            size = w.get("group_size")
            if not isinstance(size, int) or size <= 0:
                raise bad("weights.group_size", size, "a positive number of inputs")
            return PackScheme(bits, size)
        if strategy == "channel":
            return PackScheme(bits, 0)
        raise bad("weights.strategy", strategy, "pack-quantized: group or channel")
    if bits != 8 or wtype not in ("float", "int"):
        raise bad("weights.num_bits", bits, f"format {fmt!r}: 8-bit float or int weights; "
                  "4-bit weights come as pack-quantized")
    kind = "fp8" if wtype == "float" else "int8"
    block = None
    if strategy == "block" and kind == "fp8":
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise bad("weights.block_structure", block, "[rows, columns]")
        block = tuple(block)
    elif strategy not in ("tensor", "channel"):
        raise bad("weights.strategy", strategy, f"{kind}: tensor, channel" + (", block" if kind == "fp8" else ""))
    act, act_group = parse_activations(where, a, kind, bad)
    return W8A8Scheme(kind=kind, weight_strategy=strategy, act=act, block=block, act_group=act_group,
                      method=METHOD)


def parse_activations(where: str, a: dict | None, kind: str, bad) -> tuple[str | None, int]:
    if a is None:
        return None, 0
    want_type = "float" if kind == "fp8" else "int"
    if a.get("num_bits") != 8 or a.get("type", "int") != want_type:
        raise bad("input_activations", {k: a.get(k) for k in ("num_bits", "type")},
                  f"{kind} weights take 8-bit {want_type} activations")
    if not a.get("symmetric", True):
        raise bad("input_activations.symmetric", False, "symmetric activations only")
    strategy, dynamic = a.get("strategy"), a.get("dynamic")
    if strategy == "token" and dynamic:
        return "token", 0
    if strategy == "tensor":
        return ("tensor" if dynamic else "static"), 0
    if strategy == "group" and dynamic and kind == "fp8" and isinstance(a.get("group_size"), int) \
            and a["group_size"] > 0:
        return "group", a["group_size"]
    raise bad("input_activations", {"strategy": strategy, "dynamic": dynamic},
              "dynamic token, dynamic or static tensor, dynamic group (fp8)")


def matches(prefix: str, patterns: list[str]) -> bool:
    """A target / ignore entry: ``re:<regex>`` (``re.match``), or the name or a name suffix."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], prefix):
                return True
        elif p == "Linear" or prefix == p or prefix.endswith("." + p):
            return True
    return False


class CompressedTensors(QuantMethod):
    """Dispatches each linear layer to its group's scheme; used directly, the group targeting
    ``Linear`` (or the only group) runs every layer."""

    name = METHOD
    capabilities = W8A8_CAPABILITIES
    Options = CompressedTensorsOptions

    def __init__(self, options: CompressedTensorsOptions) -> None:
        super().__init__(options)
        if not options.config_groups:
            raise ModelLoadError(f"quant method {METHOD!r}: no config_groups; it reads its schemes from a "
                                 "checkpoint's config.json quantization_config, and this one has none")
        self.methods: dict[str, QuantMethod] = {
            name: self._method(parse_group(name, group, options.format))
            for name, group in options.config_groups.items()}
        default = [n for n, g in options.config_groups.items() if "Linear" in g["targets"]]
        self.default = self.methods[(default or list(self.methods))[0]]

    def _method(self, scheme: W8A8Scheme | PackScheme) -> QuantMethod:
        if isinstance(scheme, PackScheme):
            return PackQuantized(self.options, scheme)
        return W8A8Linear(self.options, scheme)

    @classmethod
    def from_checkpoint_config(cls, quantization_config):
        config = dict(quantization_config)
        config["ignore"] = config.get("ignore") or []
        return cls.Options(**{k: v for k, v in config.items() if k in cls.Options.model_fields})

    def method_for_layer(self, prefixes):
        groups = []
        for prefix in prefixes:
            if matches(prefix, self.options.ignore):
                groups.append(None)
                continue
            found = [n for n, g in self.options.config_groups.items() if matches(prefix, g["targets"])]
            groups.append(found[0] if found else None)
        if len(set(groups)) > 1:
            described = ", ".join(f"{p}: {g or 'not quantized'}" for p, g in zip(prefixes, groups))
            raise ModelLoadError(f"quant method {METHOD!r}: the pieces of one fused layer are quantized "
                                 f"differently ({described}); they must share a scheme")
        return Unquantized() if groups[0] is None else self.methods[groups[0]]

    # used directly (not through method_for_layer): the default group's scheme
    def create_weights(self, layer, in_features, out_features, dtype, bias):
        self.default.create_weights(layer, in_features, out_features, dtype, bias)

    def shard_layout(self, layer, param_name):
        return self.default.shard_layout(layer, param_name)

    def input_layout(self, layer, param_name):
        return self.default.input_layout(layer, param_name)

    def load_shard(self, layer, param_name, tensor, shard_offset, shard_size):
        self.default.load_shard(layer, param_name, tensor, shard_offset, shard_size)

    def process_weights_after_loading(self, layer):
        self.default.process_weights_after_loading(layer)

    def apply(self, layer, x):
        return self.default.apply(layer, x)


class PackQuantized(PackedMethod):
    """pack-quantized weights through the GPTQ machinery: ``weight_packed.T`` is GPTQ's ``qweight``
    (packed along the input), zeros are the constant offset ``2**(bits-1)``."""

    name = METHOD
    DROP = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, options: W8A8Options, scheme: PackScheme) -> None:
        super().__init__(options)
        self.scheme = scheme

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        bits, p = self.scheme.bits, values_per_word(self.scheme.bits)
        group = check_group_size(self.name, self.scheme.group_size or -1, in_features)
        check_divisible(self.name, "in_features", in_features, p)
        check_divisible(self.name, "out_features", out_features, p)
        layer.weight_packed = int_param(out_features, in_features * bits // 32)
        layer.weight_scale = float_param(out_features, in_features // group)
        layer.weight_shape = int_param(2)
        layer.weight_shape.data.copy_(torch.tensor([out_features, in_features]))
        make_bias(layer, out_features, dtype, bias)
        layer.act_dtype = dtype
        layer.group = group

    def shard_layout(self, layer, param_name):
        return None if param_name == "weight_shape" else (0, 1)

    def input_layout(self, layer, param_name):
        if param_name == "weight_packed":
            return 1, values_per_word(self.scheme.bits)
        if param_name == "weight_scale" and self.scheme.group_size:
            return 1, self.scheme.group_size
        return None  # per-channel scales, weight_shape: whole on every rank

    def load_shard(self, layer, param_name, tensor, shard_offset, shard_size):
        if param_name == "weight_shape":
            in_features = layer.weight_packed.shape[1] * 32 // self.scheme.bits
            want = [shard_size, getattr(layer, "full_in_features", in_features)]
            got = tensor.tolist() if tensor.numel() == 2 else None
            if hasattr(layer, "tp_starts") and got is not None:  # column-parallel: this rank's rows only
                want[0] = got[0]
            if got != want:
                raise ValueError(f"says {tensor.tolist()}; this piece of the layer is {want} ([out, in])")
            return
        if param_name == "weight_packed" and tensor.dtype != torch.int32:
            raise ValueError(f"has dtype {tensor.dtype}; pack-quantized weights are int32 words")
        super().load_shard(layer, param_name, tensor, shard_offset, shard_size)

    def normalize(self, layer):
        out, in_features = layer.weight_packed.shape[0], layer.weight_scale.shape[1] * layer.group
        offset = 2 ** (self.scheme.bits - 1)
        groups = layer.weight_scale.shape[1]
        layer.ct_qzeros = pack_cols(torch.full((groups, out), offset, dtype=torch.int32,
                                               device=layer.weight_packed.device), self.scheme.bits)
        layer.ct_g_idx = (torch.arange(in_features, device=layer.weight_packed.device) // layer.group).int()

    def extra_drop(self):
        return ()

    def dequantize(self, layer):
        q = unpack_cols(layer.weight_packed.data, self.scheme.bits) - 2 ** (self.scheme.bits - 1)
        scale = layer.weight_scale.float().repeat_interleave(layer.group, dim=1)
        return (q.float() * scale).T  # [in, out]

    def int4_values(self, layer, probe=False):
        if self.scheme.bits != 4:
            return None
        if probe:
            return None, None, None, layer.group
        q = unpack_cols(layer.weight_packed.data, 4).T  # [in, out], stored + 8
        return q, torch.full_like(layer.weight_scale.T, 8), layer.weight_scale.T, layer.group

    def kernel_args(self, layer):
        return {"qweight": layer.weight_packed.T, "qzeros": layer.ct_qzeros, "scales": layer.weight_scale.T,
                "g_idx": layer.ct_g_idx, "bits": self.scheme.bits, "awq_order": False}
