"""What the weight-only methods share: options, the CPU/GPU path choice, bias and checks.

A weight-only method stores integer weights and, per call, either

- multiplies by a dense weight it dequantized once after loading
  (``dequantize_at_load``; the default wherever no fused kernel runs, i.e. on
  CPU, where unpacking on every call costs more than the matmul: same speed as
  float weights, same numerics as the quantized ones, no memory saved), or
- dequantizes inside a Triton GEMM that reads the packed weights (the default
  on CUDA, for GPTQ/AWQ 4- and 8-bit), or
- unpacks, dequantizes and multiplies in PyTorch (``dequantize_at_load: false``
  without a kernel: memory saved, slow; the reference every kernel is tested against).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from lmplug.api import BackendOptions, Capabilities, QuantMethod
from lmplug.errors import ModelLoadError

WEIGHT_ONLY_CAPABILITIES = Capabilities(devices=frozenset({"cpu", "cuda"}))


class WeightOnlyOptions(BackendOptions):
    dequantize_at_load: bool | None = Field(
        default=None, description="keep a dense dequantized weight after loading (fast, no memory "
        "saved); default: yes, unless a fused kernel reads the packed weights (gptq/awq on CUDA "
        "or with `kernel: triton`)")


class PackedOptions(WeightOnlyOptions):
    kernel: Literal["auto", "triton", "torch", "torch_packed"] = Field(
        default="auto", description="matmul on packed weights: triton (fused dequantize GEMM), torch "
        "(unpack, dequantize, matmul), torch_packed (torch's int4 CPU matmul on weights repacked at "
        "load: 4-bit, contiguous groups of 32/64/128/256, out_features a multiple of 16, bfloat16 "
        "models); auto: triton on CUDA, torch_packed on CPU where it runs, else torch")


def check_group_size(method: str, group_size: int, in_features: int) -> int:
    """The group size in rows of the input (``-1``: the whole input); raises ModelLoadError."""
    size = in_features if group_size == -1 else group_size
    if size <= 0 or in_features % size:
        raise ModelLoadError(f"quant method {method!r}: group_size {group_size} does not divide the "
                             f"layer's {in_features} input features")
    return size


def check_divisible(method: str, what: str, features: int, by: int) -> None:
    if features % by:
        raise ModelLoadError(f"quant method {method!r}: {what} {features} is not a multiple of {by}, "
                             "which the packed layout needs")


def make_bias(layer: torch.nn.Module, out_features: int, dtype: torch.dtype, bias: bool) -> None:
    layer.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                  if bias else None)


def int_param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=torch.int32), requires_grad=False)


def float_param(*shape: int, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


# -- launch tables ------------------------------------------------------------------------------
# The Triton kernels (w4a16_kernels, w8a8_kernels) choose their tiles from small tables keyed by the
# target architecture (``lmplug.kit.devices.capability``) and the number of rows M, rather
# than by ``triton.autotune``: a table is deterministic (no benchmarking on the first call, the same
# numerics every run) and every entry can be compiled for sm_80 and sm_90 without a GPU.

@dataclass(frozen=True)
class LaunchConfig:
    """One kernel launch: tile sizes, warps and software-pipelining stages (and split-K for GEMVs)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


def arch_key(cap: tuple[int, int] | None) -> str | None:
    """The table column for a compute capability: None (the interpreter / no GPU: the small tiles
    the tests exercise), ``"sm80"`` (Ampere and Ada: up to ~100 KiB of shared memory a block, which
    sm_86/sm_89 have too) or ``"sm90"`` (Hopper and newer: ~227 KiB, deeper pipelines)."""
    if cap is None:
        return None
    return "sm90" if cap >= (9, 0) else "sm80"


def m_bucket(m: int) -> int:
    """Rows of the problem by regime: 1 (one token), 16 (small decode batches), 64, 128 (prefill)."""
    return 1 if m <= 1 else 16 if m <= 16 else 64 if m <= 64 else 128


TORCH_PACKED_GROUPS = (32, 64, 128, 256)


def torch_packed_problem(dtype: torch.dtype, device: torch.device, out_features: int,
                         group: int | None) -> str | None:
    """Why torch's packed int4 CPU matmul (``_weight_int4pack_mm_for_cpu``) cannot run a layer;
    None: it can. It is fast only for bfloat16 (float32/float16 run 10-100x slower than a dense
    matmul in torch 2.13), so other dtypes are refused."""
    if device.type != "cpu":
        return f"runs on CPU (the weights are on {device.type})"
    if dtype != torch.bfloat16:
        return f"needs a bfloat16 model (got {dtype}; torch's packed CPU matmul is slow for others)"
    if group is None:
        return "needs 4-bit weights in contiguous input groups (no act-order)"
    if group not in TORCH_PACKED_GROUPS:
        return f"needs a group size in {TORCH_PACKED_GROUPS} (got {group})"
    if out_features % 16:
        return f"needs out_features divisible by 16 (got {out_features})"
    return None


def int4pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W[k, n] = scales[g, n] * (q[k, n] - zeros[g, n])`` (q, zeros in 0..15, ``[K, N]`` / ``[G, N]``)
    -> (torch's packed int4 weight, ``scale_and_zeros [G, N, 2]`` bf16), for
    ``_weight_int4pack_mm_for_cpu``, which computes ``(q - 8) * scale + zero``: zero = s * (8 - z)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.contiguous().int(), 2)
    s = scales.float()
    offset = s * (8 - zeros.float())
    return packed, torch.stack([s, offset], dim=-1).to(torch.bfloat16).contiguous()


def int4pack_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.int4pack, layer.int4pack_group,
                                                   layer.int4pack_scale_zeros)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return (y if layer.bias is None else y + layer.bias).to(x.dtype)


def wants_dense(options: WeightOnlyOptions, uses_kernel: bool) -> bool:
    if options.dequantize_at_load is not None:
        return options.dequantize_at_load
    return not uses_kernel


def replace_with_dense(layer: torch.nn.Module, weight: torch.Tensor, drop: tuple[str, ...]) -> None:
    """Swap the packed tensors ``drop`` for one dense ``weight [out, in]``."""
    for name in drop:
        delattr(layer, name)
    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)


def dense_linear(layer: torch.nn.Module, x: torch.Tensor, weight_in_out: torch.Tensor | None) -> torch.Tensor:
    """``x @ W + b`` with ``W [in, out]`` given, or the cached ``layer.weight [out, in]``."""
    if weight_in_out is None:
        return F.linear(x, layer.weight, layer.bias)
    y = x @ weight_in_out.to(x.dtype)
    return y if layer.bias is None else y + layer.bias


class PackedMethod(QuantMethod):
    """GPTQ/AWQ: int32-packed ``qweight``/``qzeros``, ``scales``; shared apply and post-processing.

    Subclasses describe their layout (``PACKED``: param -> (output axis, pack factor) or None)
    and turn a layer's tensors into the dense ``[in, out]`` weight (``dequantize``) and into
    the kernel's arguments (``kernel_args``)."""

    capabilities = WEIGHT_ONLY_CAPABILITIES
    PACKED: ClassVar[dict[str, tuple[int, int] | None]] = {}
    DROP = ("qweight", "qzeros", "scales")

    def shard_layout(self, layer, param_name):
        return self.PACKED.get(param_name, (0, 1))

    def uses_kernel(self, device: torch.device) -> bool:
        kernel = self.options.kernel
        if kernel == "triton" and device.type != "cuda" and not triton_interpreted():
            raise ModelLoadError(f"quant method {self.name!r}: `kernel: triton` needs a CUDA device "
                                 "(on CPU only under TRITON_INTERPRET=1, for tests); use `kernel: auto`")
        return kernel == "triton" or (kernel == "auto" and device.type == "cuda")

    def process_weights_after_loading(self, layer):
        self.normalize(layer)
        device = getattr(layer, self.DROP[0]).device  # the packed weight
        layer.use_kernel = self.uses_kernel(device)
        # MoE experts (``moe_expert``): no grouped kernel reads packed experts, so dense by default
        if wants_dense(self.options, layer.use_kernel and not getattr(layer, "moe_expert", False)):
            weight = self.dequantize(layer).T.to(layer.act_dtype)
            replace_with_dense(layer, weight, self.DROP + self.extra_drop())
            layer.use_kernel = False
        elif not layer.use_kernel:
            if self.uses_torch_packed(layer, device):
                q, zeros, scales, group = self.int4_values(layer)
                layer.int4pack, layer.int4pack_scale_zeros = int4pack(q, scales, zeros)
                layer.int4pack_group = group
                for name in self.DROP + self.extra_drop():
                    delattr(layer, name)
        elif not getattr(layer, "moe_expert", False):
            from lmplug_quant.w4a16_kernels import contiguous_group_size

            # found once, here (it reads g_idx): the kernel then loads one scale row per K step
            args = self.kernel_args(layer)
            layer.kernel_group_size = contiguous_group_size(args["g_idx"], args["scales"].shape[0])

    def uses_torch_packed(self, layer: torch.nn.Module, device: torch.device) -> bool:
        """``kernel: torch_packed`` (an error where it cannot run), or ``auto`` on CPU where it can."""
        kernel = self.options.kernel
        if kernel not in ("auto", "torch_packed") or getattr(layer, "moe_expert", False):
            return False  # MoE backends read experts' packed tensors themselves
        values = self.int4_values(layer, probe=True)
        group = None if values is None else values[3]
        problem = torch_packed_problem(layer.act_dtype, device, layer.out_features, group)
        if kernel == "torch_packed" and problem:
            raise ModelLoadError(f"quant method {self.name!r}: `kernel: torch_packed` {problem}; "
                                 "use `kernel: auto`")
        return problem is None

    def apply(self, layer, x):
        if hasattr(layer, "weight"):
            return dense_linear(layer, x, None)
        if hasattr(layer, "int4pack"):
            return int4pack_linear(layer, x)
        if layer.use_kernel:
            from lmplug_quant.w4a16_kernels import w4a16_gemm

            y = w4a16_gemm(x.reshape(-1, x.shape[-1]), **self.kernel_args(layer),
                           group_size=getattr(layer, "kernel_group_size", None))
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            return y if layer.bias is None else y + layer.bias
        return dense_linear(layer, x, self.dequantize(layer))

    # -- the format's part --------------------------------------------------------------------
    def normalize(self, layer: torch.nn.Module) -> None:
        """Bring loaded tensors to the form ``dequantize`` and the kernel read (once)."""

    def extra_drop(self) -> tuple[str, ...]:
        return ()

    def dequantize(self, layer: torch.nn.Module) -> torch.Tensor:
        """The dense weight ``[in, out]``, float32."""
        raise NotImplementedError

    def kernel_args(self, layer: torch.nn.Module) -> dict:
        raise NotImplementedError

    def int4_values(self, layer: torch.nn.Module, probe: bool = False) -> tuple | None:
        """4-bit weights in contiguous input groups: ``(q [K, N], zeros [G, N], scales [G, N], group)``
        with ``W = scales * (q - zeros)`` per group (``probe``: only the group matters); None: the
        layout has no such form (8-bit, act-order), so torch's packed int4 matmul cannot run it."""
        return None
