"""The first-party quant methods through the conformance suite (``lmplug.testing.QuantConformance``).

The hooks describe each format from its published layout, using the test's own packers
(``quant_packers``), not lmplug's. ``kernel: triton`` classes run the W4A16 kernel under
``TRITON_INTERPRET=1`` (tests/conftest.py); bf16 is skipped there (the interpreter's
``tl.dot`` on bf16 is wrong) and runs on GPUs.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from support import quant_packers as qp

from lmplug.testing import QuantConformance


def gptq_layout(in_f: int, out_f: int, bits: int, group: int) -> dict:
    groups = in_f // (in_f if group == -1 else group)
    return {
        "qweight": ((in_f * bits // 32, out_f), torch.int32),
        "qzeros": ((groups, out_f * bits // 32), torch.int32),
        "scales": ((groups, out_f), None),  # kept in float32 whatever the checkpoint's dtype
        "g_idx": ((in_f,), torch.int32),
    }


def gptq_options(bits: int, group_size: int, desc_act: bool, v1: bool, **extra) -> dict:
    return {"bits": bits, "group_size": group_size, "desc_act": desc_act,
            "checkpoint_format": "gptq" if v1 else "gptq_v2", **extra}


class GPTQCase(QuantConformance):
    """4-bit, group 32, act-order, v1 zeros; subclasses change the class attributes together."""

    backend = "gptq"
    bits, group_size, desc_act, v1 = 4, 32, True, True
    options: ClassVar[dict] = gptq_options(4, 32, True, True)
    max_weight_error = 0.12  # 4-bit min/max rounding of gaussian weights: ~0.1
    checkpoint_config: ClassVar[dict] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                         "desc_act": True, "sym": False, "checkpoint_format": "gptq"}

    def checkpoint_tensors(self, in_features, out_features):
        return gptq_layout(in_features, out_features, self.bits, self.group_size)

    def quantize(self, weight):
        return qp.gptq_tensors(weight, bits=self.bits, group_size=self.group_size,
                               desc_act=self.desc_act, v1=self.v1, seed=weight.shape[0])[0]

    def dequantize(self, tensors):
        bits, mask = self.bits, 2**self.bits - 1
        q = unpack(tensors["qweight"], bits, axis=0)
        z = unpack(tensors["qzeros"], bits, axis=1)
        z = (z + 1) & mask if self.v1 else z
        g = tensors["g_idx"].long()
        return ((q - z[g]).double() * tensors["scales"].double()[g]).float().T


class AWQCase(QuantConformance):
    backend = "awq"
    max_weight_error = 0.12
    checkpoint_config: ClassVar[dict] = {"quant_method": "awq", "w_bit": 4, "q_group_size": 32,
                                         "zero_point": True, "version": "GEMM"}
    options: ClassVar[dict] = {"group_size": 32}

    def checkpoint_tensors(self, in_features, out_features):
        return {
            "qweight": ((in_features, out_features // 8), torch.int32),
            "qzeros": ((in_features // 32, out_features // 8), torch.int32),
            "scales": ((in_features // 32, out_features), None),
        }

    def quantize(self, weight):
        return qp.awq_tensors(weight, group_size=32)[0]

    def dequantize(self, tensors):
        q = unpack(tensors["qweight"], 4, axis=1, order=qp.AWQ_PACK_ORDER)
        z = unpack(tensors["qzeros"], 4, axis=1, order=qp.AWQ_PACK_ORDER)
        g = torch.arange(q.shape[0]) // 32
        return ((q - z[g]).double() * tensors["scales"].double()[g]).float().T


def unpack(words: torch.Tensor, bits: int, axis: int, order: list[int] | None = None) -> torch.Tensor:
    """Spec unpacking, one value at a time along ``axis``: value j of a word at bit j * bits;
    with ``order``, value j belongs to position ``order[j]`` of its group."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w.movedim(axis, -1)
    out = torch.empty(*w.shape[:-1], w.shape[-1] * per, dtype=torch.int64)
    for j in range(per):
        pos = order[j] if order is not None else j
        out[..., pos::per] = (w >> (j * bits)) & (2**bits - 1)
    return out.movedim(-1, axis)


class TestGPTQ4ActOrderV1(GPTQCase):
    pass


class TestGPTQ4GroupAllV2(GPTQCase):
    group_size, desc_act, v1 = -1, False, False
    options: ClassVar[dict] = gptq_options(4, -1, False, False)
    max_weight_error = 0.2  # one scale per output column over the whole input


class TestGPTQ8(GPTQCase):
    bits, desc_act = 8, False
    options: ClassVar[dict] = gptq_options(8, 32, False, True)
    max_weight_error = 0.01


class TestGPTQ4PerCallTorch(GPTQCase):
    options: ClassVar[dict] = gptq_options(4, 32, True, True, dequantize_at_load=False, kernel="torch")


class TestGPTQ4Triton(GPTQCase):
    options: ClassVar[dict] = gptq_options(4, 32, True, True, kernel="triton")
    skip_bf16_under_triton_interpreter = True


class TestAWQ(AWQCase):
    pass


class TestAWQTriton(AWQCase):
    options: ClassVar[dict] = {"group_size": 32, "kernel": "triton"}
    skip_bf16_under_triton_interpreter = True


class TestRTNInt8(QuantConformance):
    """RTN reads a float checkpoint; ``dequantize`` is the published round-to-nearest rule."""

    backend = "rtn"
    options: ClassVar[dict] = {"bits": 8, "group_size": 32}
    bits = 8
    max_weight_error = 0.01

    def weight(self, shape):
        # RTN quantizes the weight as the model holds it (its dtype); a weight exact in every
        # dtype (bf16 values) keeps a half-precision layer from rounding a value that sits on a
        # quantization boundary differently from the float32 reference
        return super().weight(shape).bfloat16().float()

    def checkpoint_tensors(self, in_features, out_features):
        return {"weight": ((out_features, in_features), None)}

    def quantize(self, weight):
        return {"weight": weight}

    def dequantize(self, tensors):
        # in float32, as the rule is usually run: values exactly halfway between two steps
        # then round the same way here and in the method
        w = tensors["weight"].float()
        qmax = 2 ** (self.bits - 1) - 1
        blocks = w.reshape(w.shape[0], -1, 32)
        scale = blocks.abs().amax(-1, keepdim=True) / qmax
        return (torch.round(blocks / scale).clamp(-qmax - 1, qmax) * scale).reshape(w.shape)


class TestRTNInt4PerCall(TestRTNInt8):
    options: ClassVar[dict] = {"bits": 4, "group_size": 32, "dequantize_at_load": False}
    bits = 4
    max_weight_error = 0.15


# -- W8A8 and compressed-tensors ------------------------------------------------------------------
# The reference multiplies the input as the format quantizes it (``quantize_input``: fp8 / int8 per
# token, per 128-input group, or a static scale), dequantized again in float32.

def ct_options(fmt: str, weights: dict, acts: dict | None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights},
             "input_activations": acts}
    return {"format": fmt, "config_groups": {"group_0": group}, "ignore": ["lm_head"], **extra}


class FP8ChannelCase(QuantConformance):
    """compressed-tensors float-quantized: fp8 per-channel weights, dynamic per-token activations."""

    backend = "compressed-tensors"
    options: ClassVar[dict] = ct_options(
        "float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
        {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})
    checkpoint_config: ClassVar[dict] = {"quant_method": "compressed-tensors", **options}
    act = ("fp8", "token", 0)

    def checkpoint_tensors(self, in_features, out_features):
        return {"weight": ((out_features, in_features), torch.float8_e4m3fn),
                "weight_scale": ((out_features, 1), None)}

    def quantize(self, weight):
        return qp.fp8_tensor_or_channel(weight, per_channel=True)[0]

    def dequantize(self, tensors):
        return tensors["weight"].float() * tensors["weight_scale"].float()

    def quantize_input(self, x):
        kind, mode, group = self.act
        return qp.fake_quantize_input(x.float(), kind, mode, group, getattr(self, "static_scale", None))


class TestFP8ChannelToken(FP8ChannelCase):
    pass


class TestFP8ChannelTokenTriton(FP8ChannelCase):
    options: ClassVar[dict] = {**FP8ChannelCase.options, "kernel": "triton"}


class TestFP8TensorStatic(FP8ChannelCase):
    """vLLM's fp8 format: a scalar weight scale and a static per-tensor input scale."""

    backend = "fp8"
    options: ClassVar[dict] = {"quantized_checkpoint": True, "activation_scheme": "static"}
    checkpoint_config: ClassVar[dict] = {"quant_method": "fp8", "activation_scheme": "static"}
    act = ("fp8", "static", 0)
    static_scale = 0.01

    def checkpoint_tensors(self, in_features, out_features):
        return {"weight": ((out_features, in_features), torch.float8_e4m3fn),
                "weight_scale": ((1,), None), "input_scale": ((1,), None)}

    def quantize(self, weight):
        tensors = qp.fp8_tensor_or_channel(weight, per_channel=False)[0]
        return {**tensors, "input_scale": torch.tensor([self.static_scale])}

    def dequantize(self, tensors):
        return tensors["weight"].float() * tensors["weight_scale"].float().reshape(1, 1)


class FP8BlockCase(FP8ChannelCase):
    """HF / DeepSeek-V3 block fp8: 128x128 weight blocks (partial at these sizes), activations per
    token per 128 inputs."""

    backend = "fp8"
    options: ClassVar[dict] = {"quantized_checkpoint": True, "weight_block_size": [128, 128]}
    checkpoint_config: ClassVar[dict] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "fmt": "e4m3", "weight_block_size": [128, 128]}
    act = ("fp8", "group", 128)

    def checkpoint_tensors(self, in_features, out_features):
        return {"weight": ((out_features, in_features), torch.float8_e4m3fn),
                "weight_scale_inv": ((-(-out_features // 128), -(-in_features // 128)), None)}

    def quantize(self, weight):
        return qp.fp8_block(weight, (128, 128))[0]

    def dequantize(self, tensors):
        s = tensors["weight_scale_inv"].float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        w = tensors["weight"]
        return w.float() * s[:w.shape[0], :w.shape[1]]


class TestFP8Block(FP8BlockCase):
    pass


class TestFP8BlockTriton(FP8BlockCase):
    options: ClassVar[dict] = {**FP8BlockCase.options, "kernel": "triton"}


class INT8Case(FP8ChannelCase):
    """compressed-tensors int-quantized (SmoothQuant W8A8): int8 per channel, int8 per token."""

    options: ClassVar[dict] = ct_options(
        "int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True})
    checkpoint_config: ClassVar[dict] = {"quant_method": "compressed-tensors", **options}
    act = ("int8", "token", 0)
    max_weight_error = 0.02

    def checkpoint_tensors(self, in_features, out_features):
        return {"weight": ((out_features, in_features), torch.int8),
                "weight_scale": ((out_features, 1), None)}

    def quantize(self, weight):
        return qp.int8_channel(weight)[0]


class TestINT8ChannelToken(INT8Case):  # torch._int_mm on CPU
    pass


class TestINT8Reference(INT8Case):
    backend = "int8"
    options: ClassVar[dict] = {"quantized_checkpoint": True, "dequantize_at_load": False}
    checkpoint_config: ClassVar[dict] = {"quant_method": "int8"}


class TestINT8Triton(INT8Case):
    options: ClassVar[dict] = {**INT8Case.options, "kernel": "triton"}


class PackQuantizedCase(QuantConformance):
    """compressed-tensors pack-quantized int4, group 32 (W4A16)."""

    backend = "compressed-tensors"
    options: ClassVar[dict] = ct_options(
        "pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}, None)
    checkpoint_config: ClassVar[dict] = {"quant_method": "compressed-tensors", **options}
    max_weight_error = 0.15

    def checkpoint_tensors(self, in_features, out_features):
        return {"weight_packed": ((out_features, in_features // 8), torch.int32),
                "weight_scale": ((out_features, in_features // 32), None),
                "weight_shape": ((2,), None)}

    def quantize(self, weight):
        return qp.pack_quantized(weight, 4, 32)[0]

    def dequantize(self, tensors):
        q = unpack(tensors["weight_packed"], 4, axis=1) - 8
        return (q.double() * tensors["weight_scale"].double().repeat_interleave(32, 1)).float()


class TestPackQuantizedInt4(PackQuantizedCase):
    pass


class TestPackQuantizedInt4Triton(PackQuantizedCase):
    options: ClassVar[dict] = {**PackQuantizedCase.options, "kernel": "triton"}
    skip_bf16_under_triton_interpreter = True
