"""An architecture built on lmplug's kit: Arcee (AFM), a Llama decoder whose feed-forward block is
not gated: ``down(relu(up(x)) ** 2)``.

Everything but that block comes from ``lmplug.kit.decoder``: attention through the chosen attention
backend and KV cache, RMSNorm, RoPE, the linear layers through the chosen quant method, and the
tensor-parallel layout (``column_linear`` / ``row_linear`` split the block across ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from lmplug.api import TENSOR_PARALLEL, Architecture, Capabilities, ModelConfig, QuantMethod
from lmplug.kit.decoder import DecoderForCausalLM
from lmplug.kit.parallel import ParallelState
from lmplug.kit.parallel_layers import column_linear, row_linear


class ReluSquaredMLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod, tp: ParallelState) -> None:
        super().__init__()
        start, width = tp.split(cfg.intermediate_size)  # a slice of the width per rank
        self.up_proj = column_linear(cfg.hidden_size, {"up_proj": (start, width)}, bias=cfg.mlp_bias,
                                     dtype=dtype, quant=quant, tp=tp)
        self.down_proj = row_linear(cfg.intermediate_size, {"down_proj": cfg.hidden_size}, bias=cfg.mlp_bias,
                                    dtype=dtype, quant=quant, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class ArceeForCausalLM(DecoderForCausalLM):
    # checkpoint names of the block's two projections (the kit's decoder knows attention's)
    STACKED: ClassVar[dict[str, tuple[str, str]]] = {
        **{k: v for k, v in DecoderForCausalLM.STACKED.items() if not k.startswith("mlp.")},
        "mlp.up_proj": ("mlp.up_proj", "up_proj"),
        "mlp.down_proj": ("mlp.down_proj", "down_proj"),
    }

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod) -> torch.nn.Module:
        return ReluSquaredMLP(cfg, dtype, quant, self.tp)


class ArceeArchitecture(Architecture):
    """Arcee (AFM-4.5B and its kin): ``model_type: arcee``."""

    name = "arcee"
    model_types = ("arcee",)
    hf_architectures = ("ArceeForCausalLM",)
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), features=frozenset({TENSOR_PARALLEL}),
                                priority=10)

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        config = ModelConfig.from_hf(dict(hf_config), where)
        if config.hidden_act != "relu2":
            from lmplug.errors import ModelLoadError

            raise ModelLoadError(f"{where}: hidden_act {config.hidden_act!r}: the arcee architecture runs relu2")
        return config

    def build(self, model_config: ModelConfig, *, dtype: Any, quant: Any, attention: Any, max_model_len: int,
              parallel: Any, moe: Any = None, mixer: Any = None) -> torch.nn.Module:
        return ArceeForCausalLM(model_config, dtype, quant, attention, max_model_len, parallel=parallel)
