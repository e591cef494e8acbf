"""Building blocks shared by the architectures: norms, activations, RoPE and linear layers.

Linear layers delegate their math to a ``QuantMethod`` (``Unquantized`` by
default). Projections that read the same input are fused into one matmul
(q/k/v, gate/up); the loader fills each fused weight shard by shard.

RMSNorm (with the residual add), SiLU * mul, tanh-GELU * mul and RoPE take one C call each for float32
CPU tensors (``fused_cpu``): at batch 1 their cost is the op count, not the arithmetic.
Their PyTorch forms here are the reference and serve every other device and dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmplug.interfaces.quant import QuantMethod
from lmplug.kit import fused_cpu
from lmplug.kit.rope import RotaryEmbedding


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    # the fused paths read the weight from ``_parameters``: ``self.weight`` goes through
    # nn.Module.__getattr__, about 1-2 us a read here, twice per norm, 60 norms a decode token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = fused_cpu.active(x)
        weight = self._parameters["weight"]
        if lib is not None and x.stride(-1) == 1 and weight.dtype == torch.float32:
            return fused_cpu.rms_norm(lib, x, weight, self.eps)
        return self.reference(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, RMSNorm(x + residual))``. The fused path writes the sum into ``x``,
        so ``x`` must be a tensor the caller owns (a block's fresh output)."""
        lib = fused_cpu.active(x)
        weight = self._parameters["weight"]
        if (lib is not None and weight.dtype == torch.float32 and residual.dtype == torch.float32
                and x.shape == residual.shape and x.is_contiguous() and residual.is_contiguous()):
            return fused_cpu.add_rms_norm(lib, x, residual, weight, self.eps)
        total = x + residual
        return total, self.reference(total)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch RMSNorm: every device and dtype; what the fused path is tested against."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # half precision: normalise in fp32, as the reference implementations do
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up output ``x`` [T, 2n] (gate first) -> [T, n]."""
    return _gated(x, fused_cpu.silu_mul, silu_and_mul_reference)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU: ``gelu_tanh(gate) * up`` of a fused gate/up output ``x`` [T, 2n] (gate first) -> [T, n]."""
    return _gated(x, fused_cpu.gelu_tanh_mul, gelu_tanh_and_mul_reference)


def _gated(x: torch.Tensor, fused, reference) -> torch.Tensor:
    """The fused op where ``x`` takes the fused path (float32 CPU rows, dense), else the reference."""
    lib = fused_cpu.active(x)
    if lib is not None and x.dim() == 2 and x.stride(1) == 1:
        return fused(lib, x)
    return reference(x)


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def apply_rope(rope: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope(positions, q, k)``; on the fused path q and k ([T, N, D] views of a fresh
    projection, heads dense) are rotated in place. A ``RotaryEmbedding`` subclass with its own
    ``forward`` keeps it."""
    lib = fused_cpu.active(q)
    if lib is None or type(rope).forward is not RotaryEmbedding.forward:
        return rope(positions, q, k)
    cos, sin = rope._buffers["cos"], rope._buffers["sin"]  # not through nn.Module.__getattr__ (~2 us each)
    if (cos.dtype != torch.float32 or positions.dtype != torch.int64 or k.dtype != torch.float32
            or q.stride(-2) != q.shape[-1] or k.stride(-2) != k.shape[-1] or q.stride(-1) != 1 or k.stride(-1) != 1):
        return rope(positions, q, k)
    fused_cpu.rope_qk_(lib, q, k, positions, cos, sin)
    return q, k


class Linear(torch.nn.Module):
    """A linear layer whose output may be the concatenation of several shards.

    ``shards`` maps a checkpoint name suffix (e.g. ``"q_proj"``) to its
    output size; the loader calls ``load_shard`` for each. A row-parallel layer
    (tensor parallelism) holds input features ``[input_start, input_start +
    in_features)`` of the checkpoint's ``full_in_features``; quant methods may read both.
    """

    def __init__(self, in_features: int, shards: dict[str, int], *, bias: bool, dtype: torch.dtype,
                 quant: QuantMethod, input_start: int = 0, full_in_features: int | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.input_start = input_start
        self.full_in_features = full_in_features or in_features
        self.shards = dict(shards)
        self.out_features = sum(shards.values())
        self.quant = quant
        self.dtype, self.has_bias = dtype, bias
        # LoRA slots (``lmplug.kit.lora``), a plain attribute: None unless the engine serves adapters
        self.lora = None
        quant.create_weights(self, in_features, self.out_features, dtype, bias)

    def bind_checkpoint_prefixes(self, prefixes: list[str]) -> None:
        """Let the quant method choose this layer's method from its shards' checkpoint prefixes
        (``QuantMethod.method_for_layer``); a different one re-creates the weights."""
        method = self.quant.method_for_layer(prefixes)
        if method is self.quant:
            return
        device = next(iter(self.parameters()), torch.empty(0)).device
        for name in list(self._parameters):
            delattr(self, name)
        self.quant = method
        with torch.device(device):
            method.create_weights(self, self.in_features, self.out_features, self.dtype, self.has_bias)

    def shard_range(self, shard: str) -> tuple[int, int]:
        start = 0
        for name, size in self.shards.items():
            if name == shard:
                return start, start + size
            start += size
        raise KeyError(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.__dict__["lora"]
        if lora is None:
            return self.quant.apply(self, x)
        return lora.add(self.quant.apply(self, x), x)


def bind_quant_methods(model: torch.nn.Module) -> None:
    """Give every ``Linear`` its shards' checkpoint prefixes (from the model's
    ``checkpoint_name``, else the module path), so a quant method can treat layers differently
    (a checkpoint's ignore list, per-layer schemes). Runs before the weights are loaded."""
    describe = getattr(model, "checkpoint_name", None)
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            prefixes = [describe(f"{path}.weight", shard).rpartition(".")[0] if describe else path
                        for shard in module.shards]
            module.bind_checkpoint_prefixes(prefixes)
