"""W8A8 (fp8 and int8 weights and activations): the scheme, activation quantizers and the layer.

A linear layer holds 8-bit weights ``q_w [N, K]`` (the checkpoint's
``[out, in]``) with scales, and quantizes its input on every call, so the
matmul runs on 8-bit operands: ``y = (q_a * s_a) @ (q_w * s_w)^T + b``.

Weight scales (``W8A8Scheme.weight_strategy``): one per tensor (a scalar per
checkpoint tensor; a fused q/k/v layer keeps its shards' own scales), one per
output channel (``[out, 1]``), or one per ``bn x bk`` block
(``[ceil(out / bn), ceil(in / bk)]``, DeepSeek-V3's 128x128). After loading
they are expanded to rows, ``s_w [N, KG]`` float32 with ``KG`` 1 or
``ceil(K / bk)``, so fused shards of any size and every strategy reach one
kernel in one form.

Activations (``act``): ``token`` - dynamic, one scale per token
(``amax / qmax``); ``group`` - dynamic, one per token per ``act_group``
inputs (block fp8); ``tensor`` - dynamic, one for the whole batch; ``static``
- the checkpoint's ``input_scale`` (the largest of a fused layer's shards, as
vLLM does); None - weights only (the input stays in float). Quantization is
``q = clamp(x / s, -qmax, qmax)`` cast to fp8 e4m3 (``qmax`` 448), or
``clamp(round(x / s), -128, 127)`` for int8 (``qmax`` 127, symmetric),
computed in float32 - the same code before the Triton kernel and the PyTorch
paths, so all see the same 8-bit operands.

Paths (``kernel``): the Triton scaled GEMM (``w8a8_kernels``; CUDA, fp8 needs
compute capability 8.9+; on CPU only under ``TRITON_INTERPRET=1``); int8 on
CPU: ``torch._int_mm`` (exact int32 accumulation; one thread, 2048 -> 5632: 1.7x a
float32 matmul for one token, 4-7x for 4-64 tokens; about even at 576 -> 1536,
``benchmarks/bench_quant_cpu.py``); otherwise the reference: both
operands dequantized to float32 and one matmul, the weight dequantized once
after loading unless ``dequantize_at_load: false``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from lmplug.api import BackendOptions, Capabilities, QuantMethod
from lmplug.errors import ModelLoadError
from lmplug.kit.devices import capability, describe

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
INT8_MAX = 127.0
FLOAT_WEIGHTS = (torch.float32, torch.float16, torch.bfloat16)
MIN_AMAX = 1e-12  # an all-zero row still gets a finite scale
FP8_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (sm_89) and Hopper (sm_90)

W8A8_CAPABILITIES = Capabilities(devices=frozenset({"cpu", "cuda"}))


class W8A8Options(BackendOptions):
    kernel: Literal["auto", "triton", "torch"] = Field(
        default="auto", description="triton: the scaled 8-bit GEMM (CUDA; fp8 needs compute capability "
        "8.9+); torch: int8 through torch._int_mm on CPU, else both operands dequantized to float32; "
        "auto: triton on CUDA where it runs, else torch")
    dequantize_at_load: bool | None = Field(
        default=None, description="torch path: keep the weight dequantized to float32 after loading "
        "(activations are still quantized); default: yes where the path would otherwise dequantize "
        "it on every call (fp8 on CPU)")


class CheckpointW8A8Options(W8A8Options):
    """What ``fp8`` and ``int8`` share: an 8-bit checkpoint or a float one quantized at load, and
    dynamic (per token) or static (the checkpoint's ``input_scale``) activation scales."""

    quantized_checkpoint: bool = Field(
        default=False, description="the checkpoint holds 8-bit weights with their scales (set when "
        "config.json's quantization_config names the method); false: quantize a float checkpoint at load")
    activation_scheme: Literal["dynamic", "static"] = Field(
        default="dynamic", description="dynamic: a scale per token (fp8 with block scales: per token "
        "and weight block column); static: the checkpoint's per-tensor input_scale")

    @model_validator(mode="after")
    def _static_needs_checkpoint(self):
        if self.activation_scheme == "static" and not self.quantized_checkpoint:
            raise ValueError("activation_scheme static needs a checkpoint with input_scale tensors")
        return self


@dataclass(frozen=True)
class W8A8Scheme:
    """How one layer is quantized; ``method`` names the quant method in error messages."""

    kind: Literal["fp8", "int8"]
    weight_strategy: Literal["tensor", "channel", "block"]
    act: Literal["token", "group", "tensor", "static"] | None
    block: tuple[int, int] | None = None  # (output rows, input columns) of a weight block
    act_group: int = 0  # inputs per activation scale ("group")
    serialized: bool = True  # the checkpoint holds 8-bit weights; False: quantize float ones at load
    scale_name: str = "weight_scale"
    method: str = "w8a8"

    @property
    def weight_dtype(self) -> torch.dtype:
        return FP8 if self.kind == "fp8" else torch.int8

    @property
    def qmax(self) -> float:
        return FP8_MAX if self.kind == "fp8" else INT8_MAX

    def group_k(self) -> int:
        """Inputs per scale along K shared by weights and activations (0: one scale per row)."""
        wk = self.block[1] if self.weight_strategy == "block" else 0
        ak = self.act_group if self.act == "group" else 0
        if wk and ak and wk != ak:
            raise ModelLoadError(f"quant method {self.method!r}: weight blocks of {wk} inputs and "
                                 f"activation groups of {ak} inputs cannot share one scaled GEMM")
        return wk or ak

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        """The checkpoint's weight scale for a tensor of ``out_features`` rows."""
        if self.weight_strategy == "tensor":
            return (1,)
        if self.weight_strategy == "channel":
            return (out_features, 1)
        bn, bk = self.block
        return (-(-out_features // bn), -(-in_features // bk))


# -- activations and the reference ----------------------------------------------------------------

def quantize_activations(x: torch.Tensor, scheme: W8A8Scheme, group_k: int,
                         static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``q [M, K]`` fp8/int8, ``s [M, KG]`` float32), ``KG`` 1 or ``ceil(K / group_k)``."""
    xf = x.float()
    m, k = xf.shape
    qmax = scheme.qmax
    if scheme.act == "static":
        scale = static_scale.float().reshape(1, 1).expand(m, 1)
    elif scheme.act == "tensor":
        scale = (xf.abs().amax().clamp(min=MIN_AMAX) / qmax).reshape(1, 1).expand(m, 1)
    elif scheme.act == "group":
        g = scheme.act_group
        kg = -(-k // g)
        padded = torch.nn.functional.pad(xf, (0, kg * g - k)) if kg * g != k else xf
        scale = padded.reshape(m, kg, g).abs().amax(-1).clamp(min=MIN_AMAX) / qmax
    else:  # token
        scale = xf.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX) / qmax
    q = xf / expand_scales(scale, group_k if scale.shape[1] > 1 else 0, k)
    if scheme.kind == "fp8":
        q = q.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    else:
        q = torch.round(q).clamp(-128, 127).to(torch.int8)
    if group_k and scale.shape[1] == 1:  # one scale per token, but the GEMM steps through K groups
        scale = scale.expand(m, -(-k // group_k))
    return q, scale.contiguous()


def expand_scales(scale: torch.Tensor, group_k: int, k: int) -> torch.Tensor:
    """``[R, KG]`` scales -> one per element ``[R, K]`` (or ``[R, 1]``, broadcastable, if KG is 1)."""
    if scale.shape[1] == 1:
        return scale
    return scale.repeat_interleave(group_k, dim=1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """8-bit ``q [R, K]`` with scales ``[R, KG]`` -> float32 ``[R, K]``."""
    return q.float() * expand_scales(scale, group_k, q.shape[1])


def scaled_mm_reference(qa: torch.Tensor, sa: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
                        group_k: int) -> torch.Tensor:
    """What the Triton kernel computes, in float32: ``dequantize(a) @ dequantize(w)^T``."""
    return dequantize(qa, sa, group_k) @ dequantize(qw, sw, group_k).T


def quantize_weight(weight: torch.Tensor, scheme: W8A8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` weight -> (8-bit ``[N, K]``, row scales ``[N, KG]``): round-to-nearest with
    ``scale = amax / qmax`` over the tensor, each row or each block (for ``serialized: False``)."""
    w = weight.float()
    n, k = w.shape
    if scheme.weight_strategy == "tensor":
        scale = (w.abs().amax().clamp(min=MIN_AMAX) / scheme.qmax).reshape(1, 1).expand(n, 1)
        group_k = 0
    elif scheme.weight_strategy == "channel":
        scale = w.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX) / scheme.qmax
        group_k = 0
    else:
        bn, bk = scheme.block
        rb, cb = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(w, (0, cb * bk - k, 0, rb * bn - n))
        blocks = padded.reshape(rb, bn, cb, bk).abs().amax((1, 3)).clamp(min=MIN_AMAX) / scheme.qmax
        scale = blocks.repeat_interleave(bn, dim=0)[:n]
        group_k = bk
    q = w / expand_scales(scale, group_k, k)
    if scheme.kind == "fp8":
        q = q.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    else:
        q = torch.round(q).clamp(-128, 127).to(torch.int8)
    return q, scale.contiguous()


# -- the layer --------------------------------------------------------------------------------------

class W8A8Linear(QuantMethod):
    """One W8A8 scheme over linear layers; ``fp8``/``int8`` and compressed-tensors' layers use it."""

    name = "w8a8"
    capabilities = W8A8_CAPABILITIES
    Options = W8A8Options

    def __init__(self, options: W8A8Options, scheme: W8A8Scheme | None = None) -> None:
        super().__init__(options)
        self.scheme = scheme if scheme is not None else self.make_scheme(options)

    def make_scheme(self, options) -> W8A8Scheme:
        raise NotImplementedError

    # -- creating and loading -------------------------------------------------------------------
    def create_weights(self, layer, in_features, out_features, dtype, bias):
        s = self.scheme
        s.group_k()  # raises for incompatible weight blocks / activation groups
        if s.serialized:
            layer.weight = _param(torch.zeros(out_features, in_features, dtype=s.weight_dtype))
            setattr(layer, s.scale_name, _param(torch.zeros(s.scale_shape(out_features, in_features))))
            if s.act == "static":
                layer.input_scale = _param(torch.zeros(1))
        else:
            layer.weight = _param(torch.empty(out_features, in_features, dtype=dtype))
        layer.bias = _param(torch.zeros(out_features, dtype=dtype)) if bias else None
        layer.act_dtype = dtype

    def shard_layout(self, layer, param_name):
        s = self.scheme
        if param_name == "input_scale" or (param_name == s.scale_name and s.weight_strategy == "tensor"):
            return None  # a scalar per checkpoint tensor (load_shard keeps each piece's own)
        if param_name == s.scale_name and s.weight_strategy == "block":
            return 0, s.block[0]
        return 0, 1

    def input_layout(self, layer, param_name):
        s = self.scheme
        if param_name == "weight":
            return 1, 1
        if param_name == s.scale_name and s.weight_strategy == "block":
            return 1, s.block[1]
        return None

    def load_shard(self, layer, param_name, tensor, shard_offset, shard_size):
        s = self.scheme
        if param_name == "weight" and s.serialized and tensor.dtype != s.weight_dtype:
            raise ValueError(f"has dtype {tensor.dtype}; quant method {s.method!r} ({s.kind} W8A8) "
                             f"expects {s.weight_dtype} weights")
        if param_name == "weight" and not s.serialized and tensor.dtype not in FLOAT_WEIGHTS:
            raise ValueError(f"has dtype {tensor.dtype}: the checkpoint is already quantized, and quant "
                             f"method {s.method!r} quantizes float weights at load; use the method its "
                             "config.json quantization_config names")
        if param_name not in (s.scale_name, "input_scale") or not s.serialized:
            super().load_shard(layer, param_name, tensor, shard_offset, shard_size)
            return
        in_features = layer.weight.shape[1]
        want = (1,) if param_name == "input_scale" else s.scale_shape(shard_size, in_features)
        got = tuple(tensor.shape)
        if got != want and not (want == (1,) and tensor.numel() == 1):
            raise ValueError(f"has shape {got}; a {s.weight_strategy}-scaled shard of {shard_size} "
                             f"output features x {in_features} inputs needs {want}")
        if not tensor.is_floating_point():
            raise ValueError(f"has dtype {tensor.dtype}; scales are floating point")
        pieces = layer.__dict__.setdefault("_w8a8_pieces", {}).setdefault(param_name, [])
        pieces.append((shard_offset, shard_size, tensor.detach().float().reshape(want).clone()))
        param = getattr(layer, param_name).data
        if tuple(param.shape) == want:  # a layer of one shard: the parameter is this tensor
            param.copy_(tensor.reshape(want))

    # -- after loading --------------------------------------------------------------------------
    def process_weights_after_loading(self, layer):
        s = self.scheme
        group_k = s.group_k()
        n, k = layer.weight.shape
        if s.serialized:
            w_scale = self._row_scales(layer, n, k)
            q = layer.weight.data
            if s.act == "static":
                pieces = layer.__dict__.get("_w8a8_pieces", {}).get("input_scale")
                values = [t for _, _, t in pieces] if pieces else [layer.input_scale.data.float()]
                layer.static_input_scale = torch.stack([v.reshape(()) for v in values]).max()
                del layer.input_scale
            delattr(layer, s.scale_name)
        else:
            q, w_scale = quantize_weight(layer.weight.data, s)
        layer.__dict__.pop("_w8a8_pieces", None)
        if group_k and w_scale.shape[1] == 1:  # per-channel weights, per-group activations
            w_scale = w_scale.expand(n, -(-k // group_k))
        del layer.weight
        layer.w_scale = w_scale.float().contiguous()
        layer.group_k = group_k
        layer.path = self._path(q.device, group_k)
        if layer.path == "dense":
            layer.w_dense = dequantize(q, layer.w_scale, group_k)
        else:
            layer.qweight = _param(q.contiguous())

    def _row_scales(self, layer, n: int, k: int) -> torch.Tensor:
        """The loaded weight scales, one row per output feature: ``[N, KG]`` float32."""
        s = self.scheme
        pieces = layer.__dict__.get("_w8a8_pieces", {}).get(s.scale_name)
        if not pieces:  # filled directly (one shard), not through load_shard
            pieces = [(0, n, getattr(layer, s.scale_name).data.float())]
        kg = 1 if s.weight_strategy != "block" else -(-k // s.block[1])
        rows = torch.zeros(n, kg, device=pieces[0][2].device)
        for offset, size, t in pieces:
            if s.weight_strategy == "tensor":
                rows[offset:offset + size] = t.reshape(1, 1)
            elif s.weight_strategy == "channel":
                rows[offset:offset + size] = t.reshape(size, 1)
            else:
                rows[offset:offset + size] = t.repeat_interleave(s.block[0], dim=0)[:size]
        return rows

    def _path(self, device: torch.device, group_k: int) -> str:
        """triton | int_mm | dense (float32 weight cached) | reference (dequantized per call).

        Decided at load time, so that a GPU the kernel cannot run on (fp8 before sm_89) is an
        error naming the method, the key and the capability here, not on the first step."""
        s, kernel = self.scheme, self.options.kernel
        from lmplug_quant.common import triton_interpreted

        if s.act is not None:
            cap = capability(device)
            why = None
            if device.type != "cuda" and not triton_interpreted():
                why = "needs a CUDA device (on CPU only under TRITON_INTERPRET=1, for tests)"
            elif s.kind == "fp8" and cap is not None and cap < FP8_MIN_CAPABILITY:
                why = (f"needs compute capability 8.9+ for fp8 (Ada, Hopper); the device is "
                       f"{describe(cap)}")
            if kernel == "triton" and why:
                raise ModelLoadError(f"quant method {s.method!r}: `kernel: triton` {why}; use `kernel: auto`")
            if kernel == "triton" or (kernel == "auto" and device.type == "cuda" and why is None):
                return "triton"
            if s.kind == "int8" and device.type == "cpu" and group_k == 0:
                return "int_mm"
        dense = self.options.dequantize_at_load
        return "reference" if dense is False else "dense"

    # -- the matmul -----------------------------------------------------------------------------
    def apply(self, layer, x):
        s = self.scheme
        x2 = x.reshape(-1, x.shape[-1])
        group_k = layer.group_k
        if s.act is None:  # weights only
            w = layer.w_dense if layer.path == "dense" else dequantize(layer.qweight, layer.w_scale, group_k)
            y = x2.float() @ w.T
        else:
            qa, sa = quantize_activations(x2, s, group_k, getattr(layer, "static_input_scale", None))
            if layer.path == "triton":
                from lmplug_quant.w8a8_kernels import w8a8_gemm

                y = w8a8_gemm(qa, sa, layer.qweight, layer.w_scale, group_k=group_k, bias=layer.bias,
                              out_dtype=x.dtype)
                return y.reshape(*x.shape[:-1], y.shape[-1])
            if layer.path == "int_mm":
                y = torch._int_mm(qa, layer.qweight.T).float() * sa * layer.w_scale.T
            elif layer.path == "dense":
                y = dequantize(qa, sa, group_k) @ layer.w_dense.T
            else:
                y = scaled_mm_reference(qa, sa, layer.qweight, layer.w_scale, group_k)
        if layer.bias is not None:
            y = y + layer.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def match_name(prefix: str, patterns: list[str]) -> bool:
    """HF ``modules_to_not_convert`` / vLLM ``ignored_layers``: a pattern matches a layer whose
    checkpoint prefix contains it (``"lm_head"``, ``"mlp.down_proj"``, ``"model.layers.0."``)."""
    return any(p and p in prefix for p in patterns)
