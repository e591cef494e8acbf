"""Building blocks shared by the architectures: norms and linear layers.

Linear layers delegate their math to a ``QuantMethod`` (``Unquantized`` by
default). Projections that read the same input are fused into one matmul
(q/k/v, gate/up); the loader fills each fused weight shard by shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmplug.interfaces.common import BackendOptions, Capabilities
from lmplug.interfaces.quant import QuantMethod


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # half precision: normalise in fp32, as the reference implementations do
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


class Linear(torch.nn.Module):
    """A linear layer whose output may be the concatenation of several shards.

    ``shards`` maps a checkpoint name suffix (e.g. ``"q_proj"``) to its
    output size; the loader calls ``load_shard`` for each.
    """

    def __init__(self, in_features: int, shards: dict[str, int], *, bias: bool, dtype: torch.dtype,
                 quant: QuantMethod) -> None:
        super().__init__()
        self.in_features = in_features
        self.shards = dict(shards)
        self.out_features = sum(shards.values())
        self.quant = quant
        quant.create_weights(self, in_features, self.out_features, dtype, bias)

    def shard_range(self, shard: str) -> tuple[int, int]:
        start = 0
        for name, size in self.shards.items():
            if name == shard:
                return start, start + size
            start += size
        raise KeyError(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant.apply(self, x)
