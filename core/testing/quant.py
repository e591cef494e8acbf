"""``QuantConformance``: a quantization method's checkpoint layout, round trip and matmul.

The format's truth comes from its published description, which only the
author can write down; the author fills three hooks:

- ``checkpoint_tensors(in_features, out_features)``: name -> (shape, dtype)
  of one linear layer's tensors as the published format stores them;
- ``quantize(weight)``: those tensors for a dense weight, as a published
  packer writes them (ideally not the method's own code);
- ``dequantize(tensors)``: the dense weight they stand for, from the spec.

The suite then checks that ``create_weights`` registers exactly those
tensors (so the loader can fill them by name), that ``dequantize(quantize(W))``
is close to ``W``, that ``apply`` after loading and
``process_weights_after_loading`` equals ``x @ dequantize(tensors).T + b``
(W8A8 methods: ``quantize_input(x)`` in place of ``x``),
that two layers loaded through ``load_shard`` as the output shards of one
fused layer compute the concatenated product, and, where the method offers a C
product for the native decode step (``native_product``), that it equals ``apply``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from lmplug.kit import extras
from lmplug.kit.native import call_product
from lmplug.testing.base import Conformance
from lmplug.testing.compare import DTYPES, fail, find_mismatch, reported, tolerance_for
from lmplug.testing.reference import reference_linear

TensorLayout = dict[str, tuple[tuple[int, ...], torch.dtype | None]]


class QuantConformance(Conformance):
    family = "quant"
    shapes: ClassVar[list[tuple[int, int]]] = [(128, 64), (256, 96)]  # (in_features, out_features)
    num_tokens: ClassVar[list[int]] = [1, 7, 32]
    max_weight_error: ClassVar[float] = 0.05  # ||dequantize(quantize(W)) - W|| / ||W||
    # matmul vs the dequantized reference; atol is relative to the largest reference output
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {
        "float32": (1e-4, 1e-4),
        "float16": (4e-3, 4e-3),
        "bfloat16": (2e-2, 2e-2),
    }
    checkpoint_config: ClassVar[dict[str, Any] | None] = None  # a published `quantization_config`

    # -- the author's hooks, from the published format -----------------------------------------
    def checkpoint_tensors(self, in_features: int, out_features: int) -> TensorLayout:
        """name -> (shape, dtype or None) of one linear layer's quantized tensors (bias excluded)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement checkpoint_tensors(): the "
            f"published format's tensor names, shapes and dtypes for one layer"
        )

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight [out, in] float32 -> the checkpoint tensors a published packer writes for it."""
        raise NotImplementedError(f"{type(self).__name__} must implement quantize()")

    def dequantize(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Checkpoint tensors -> the dense [out, in] weight they stand for, per the format's spec."""
        raise NotImplementedError(f"{type(self).__name__} must implement dequantize()")

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8 methods: ``x`` quantized and dequantized the way the format quantizes a layer's
        input (e.g. fp8 per token), so the reference multiplies the same numbers; weight-only
        methods keep the default, ``x`` unchanged."""
        return x

    # -- parameters --------------------------------------------------------------------------------
    def params_shape(self) -> list:
        return [pytest.param(s, id=f"in{s[0]}-out{s[1]}") for s in self.shapes]

    def weight(self, shape: tuple[int, int]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
        return torch.randn(shape[1], shape[0], generator=gen) * 0.05

    # -- tests -------------------------------------------------------------------------------------
    def test_checkpoint_layout(self, backend_class, backend_options, shape) -> None:
        """create_weights registers the published tensors; quantize() writes them with those shapes."""
        in_f, out_f = shape
        expected = self.checkpoint_tensors(in_f, out_f)
        with reported(self.label()):
            layer = self.make_layer(backend_class(backend_options), shape, torch.float32, bias=True)
            created = layer_tensors(layer)
            packed = self.quantize(self.weight(shape))
        problems = layout_problems(
            "create_weights registered", created, {**expected, "bias": ((out_f,), None)}
        )
        problems += layout_problems("quantize() wrote", packed, expected)
        if problems:
            fail(
                f"{self.label()}, layer in_features={in_f}, out_features={out_f}:\n  - "
                + "\n  - ".join(problems)
            )

    def test_round_trip(self, shape) -> None:
        """dequantize(quantize(W)) is W up to the format's quantization error."""
        w = self.weight(shape)
        w2 = self.dequantize(self.quantize(w)).float()
        if w2.shape != w.shape:
            fail(
                f"{self.label()}: dequantize returned shape {tuple(w2.shape)} for a weight of {tuple(w.shape)}"
            )
        err = float((w2 - w).norm() / w.norm())
        if not err <= self.max_weight_error:
            fail(
                f"{self.label()}, weight {tuple(w.shape)}: dequantize(quantize(W)) differs from W by "
                f"{err:.3g} (relative Frobenius norm), allowed {self.max_weight_error:g}: packing and "
                f"unpacking disagree, or the quantizer is wrong"
            )

    def test_matmul_matches_dequantized(self, backend_class, backend_options, shape, dtype) -> None:
        """apply() after loading equals x @ dequantize(tensors).T + b, for several token counts."""
        packed = self.quantize(self.weight(shape))
        w_ref = self.dequantize(packed)
        bias = torch.randn(shape[1], generator=torch.Generator().manual_seed(1)).to(DTYPES[dtype])
        atol, rtol = tolerance_for(self.tolerances, dtype)
        with reported(self.label()):
            method = backend_class(backend_options)
            layer = self.make_layer(method, shape, DTYPES[dtype], bias=True)
            load(layer, {**packed, "bias": bias}, self.label())
            method.process_weights_after_loading(layer)
            for tokens in self.num_tokens:
                x = torch.randn(tokens, shape[0], generator=torch.Generator().manual_seed(tokens))
                x = x.to(DTYPES[dtype]).to(self.device)
                y = method.apply(layer, x)
                ref = reference_linear(self.quantize_input(x.cpu()), w_ref, bias).to(y.device)
                if y.shape != ref.shape or y.dtype != x.dtype:
                    fail(
                        f"{self.label()}: apply returned {tuple(y.shape)} {y.dtype} for x "
                        f"{tuple(x.shape)} {x.dtype}; expected {tuple(ref.shape)} {x.dtype}"
                    )
                scale = float(ref.abs().max())
                bad = find_mismatch(y, ref, atol * scale, rtol)
                if bad is not None:
                    fail(
                        f"{self.label()}, layer {shape[0]}->{shape[1]}, {tokens} tokens, dtype {dtype}: "
                        f"apply() differs from x @ dequantize(tensors).T + b: "
                        f"{bad.summary(atol * scale, rtol)} (index = [token, output feature])"
                    )

    def test_fused_shards_load(self, backend_class, backend_options, shape) -> None:
        """Two layers' tensors loaded with ``load_shard`` as the output shards of one fused layer
        (as q/k/v and gate/up are) compute ``x @ [W1; W2].T + b``, in float32."""
        in_f, out_f = shape
        weights = [self.weight(shape), self.weight(shape).flip(0)]
        packed = [self.quantize(w) for w in weights]
        w_ref = torch.cat([self.dequantize(p) for p in packed])
        bias = torch.randn(2 * out_f, generator=torch.Generator().manual_seed(2))
        with reported(self.label()):
            method = backend_class(backend_options)
            layer = self.make_layer(method, (in_f, 2 * out_f), torch.float32, bias=True)
            for i, tensors in enumerate(packed):
                shard_bias = bias[i * out_f:(i + 1) * out_f]
                for name, value in {**tensors, "bias": shard_bias}.items():
                    method.load_shard(layer, name, value.to(self.device), i * out_f, out_f)
            method.process_weights_after_loading(layer)
            x = torch.randn(7, in_f, generator=torch.Generator().manual_seed(3)).to(self.device)
            y = method.apply(layer, x)
        ref = reference_linear(self.quantize_input(x.cpu()), w_ref, bias)
        atol, rtol = tolerance_for(self.tolerances, "float32")
        atol *= float(ref.abs().max())
        bad = find_mismatch(y.cpu(), ref, atol, rtol)
        if bad is not None:
            fail(f"{self.label()}, fused layer {in_f}->{out_f}+{out_f} filled by load_shard: apply() "
                 f"differs from x @ [W1; W2].T + b: {bad.summary(atol, rtol)} (index = [token, "
                 "output feature]); check shard_layout: where each tensor keeps its output axis")

    def test_native_product_matches_apply(self, backend_class, backend_options, shape) -> None:
        """Where the method offers the native decode step a C product (``native_product``, on
        the CPU in float32), it computes what ``apply`` does, bias included."""
        if self.device != "cpu":
            pytest.skip("the native decode step runs on the CPU")
        in_f, out_f = shape
        bias = torch.randn(out_f, generator=torch.Generator().manual_seed(4))
        with reported(self.label()):
            method = backend_class(backend_options)
            layer = self.make_layer(method, shape, torch.float32, bias=True)
            load(layer, {**self.quantize(self.weight(shape)), "bias": bias}, self.label())
            method.process_weights_after_loading(layer)
            call = extras.native_product(method, layer)
        if call is None:
            pytest.skip(f"{self.label()}: no native product (native_product returned None)")
        atol, rtol = tolerance_for(self.tolerances, "float32")
        for tokens in self.num_tokens:
            x = torch.randn(tokens, in_f, generator=torch.Generator().manual_seed(5 + tokens))
            with reported(self.label()):
                want = method.apply(layer, x)
                got = call_product(call, x, out_f)
            scale = float(want.abs().max())
            bad = find_mismatch(got, want, atol * scale, rtol)
            if bad is not None:
                fail(f"{self.label()}, layer {in_f}->{out_f}, {tokens} tokens: the native product "
                     f"(native_product) differs from apply(): {bad.summary(atol * scale, rtol)} "
                     "(index = [token, output feature])")

    def test_options_from_checkpoint_config(self, backend_class) -> None:
        if self.checkpoint_config is None:
            pytest.skip(
                "set `checkpoint_config` to a published checkpoint's quantization_config to check it"
            )
        with reported(self.label()):
            options = backend_class.from_checkpoint_config(dict(self.checkpoint_config))
        if not isinstance(options, backend_class.Options):
            fail(
                f"{self.label()}: from_checkpoint_config returned {type(options).__name__}, "
                f"not its Options ({backend_class.Options.__name__})"
            )

    # -- helpers -------------------------------------------------------------------------------------
    def make_layer(
        self, method, shape: tuple[int, int], dtype: torch.dtype, bias: bool
    ) -> torch.nn.Module:
        layer = torch.nn.Module()
        layer.in_features, layer.out_features = shape
        with torch.device(self.device):
            method.create_weights(layer, shape[0], shape[1], dtype, bias)
        return layer


def layer_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(layer.named_parameters())
    tensors.update(dict(layer.named_buffers()))
    return tensors


def layout_problems(what: str, got: dict[str, torch.Tensor], expected: TensorLayout) -> list[str]:
    problems = []
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing:
        problems.append(f"{what} no tensor named {missing}")
    if extra:
        problems.append(f"{what} tensors the format does not have: {extra}")
    for name in sorted(set(got) & set(expected)):
        shape, dtype = expected[name]
        t = got[name]
        if tuple(t.shape) != tuple(shape):
            problems.append(
                f"{what} {name!r} with shape {tuple(t.shape)}; the format says {tuple(shape)}"
            )
        if dtype is not None and t.dtype != dtype:
            problems.append(f"{what} {name!r} as {t.dtype}; the format says {dtype}")
    return problems


def load(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    """What the loader does: copy each checkpoint tensor into the same-named tensor, shapes equal."""
    own = layer_tensors(layer)
    for name, value in tensors.items():
        if name not in own:
            fail(f"{label}: the layer has no tensor {name!r} to load into (it has {sorted(own)})")
        if tuple(own[name].shape) != tuple(value.shape):
            fail(
                f"{label}: checkpoint tensor {name!r} has shape {tuple(value.shape)}, the layer's "
                f"{tuple(own[name].shape)}"
            )
        with torch.no_grad():
            own[name].copy_(value)
