"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE (and DeepSeek's MoE block).

The Llama decoder with some layers' MLP replaced by ``SparseMoeBlock``: a
router, every expert's weights stacked along a leading ``E`` axis, and
optionally an always-on shared expert (Qwen2-MoE gates it by a sigmoid,
DeepSeek adds it as is). The block asks its moe backend to route and to run
the experts; it does not know which backend it got. Which layers are sparse,
and how they route, comes from ``ModelConfig.moe`` (``moe_config.py``).
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
import torch.nn.functional as F

from lmplug.errors import ModelLoadError
from lmplug.interfaces.attention import AttentionBackend
from lmplug.interfaces.moe import MoEBackend
from lmplug.interfaces.quant import QuantMethod
from lmplug.models.config import ModelConfig
from lmplug.models.llama import MLP, LlamaForCausalLM


def _param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Gate(torch.nn.Module):
    """An unquantized ``x W^T`` (router logits [T, E], or Qwen2-MoE's shared-expert gate [T, 1]),
    with DeepSeek-V3's per-expert ``e_score_correction_bias`` when asked."""

    def __init__(self, hidden: int, out: int, dtype: torch.dtype, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out, hidden, dtype=dtype)
        self.e_score_correction_bias = (torch.nn.Parameter(torch.zeros(out), requires_grad=False)
                                        if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ExpertWeights(torch.nn.Module):
    """Every expert's SwiGLU weights: ``w_gate_up [E, 2I, h]`` (gate rows, then up), ``w_down [E, h, I]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.w_gate_up = _param(num_experts, 2 * intermediate, hidden, dtype=dtype)
        self.w_down = _param(num_experts, hidden, intermediate, dtype=dtype)

    @property
    def numel_per_expert(self) -> int:
        return (self.w_gate_up.numel() + self.w_down.numel()) // self.num_experts

    def shard_range(self, shard: str) -> tuple[int, int]:
        inter = self.intermediate
        return {"gate": (0, inter), "up": (inter, 2 * inter)}[shard]

    def checkpoint_pieces(self, param: str) -> list[tuple[str | None, int]]:
        """(shard, expert) of each checkpoint tensor that fills ``param``."""
        shards = ("gate", "up") if param == "w_gate_up" else (None,)
        return [(shard, e) for e in range(self.num_experts) for shard in shards]


class SparseMoeBlock(torch.nn.Module):
    """Routed experts (+ a shared expert): x [T, h] -> [T, h]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod, backend: MoEBackend) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ModelLoadError(f"a {cfg.model_type!r} model has no MoE configuration")
        self.routing = moe.routing
        self.backend = backend
        self.gate = Gate(cfg.hidden_size, moe.num_experts, dtype, correction_bias=moe.correction_bias)
        self.experts = ExpertWeights(moe.num_experts, cfg.hidden_size, moe.intermediate_size, dtype)
        self.shared_expert = (MLP(cfg, dtype, quant, intermediate_size=moe.shared_intermediate_size)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = Gate(cfg.hidden_size, 1, dtype) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E]
        ids, weights = self.backend.route(logits, self.routing,
                                          correction_bias=self.gate.e_score_correction_bias)  # [T, k]
        out = self.backend.experts(x, ids, weights, self.experts.w_gate_up, self.experts.w_down)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


# checkpoint names: the MoE block's module name and its experts' projections, per family
BLOCK_NAMES = {"mixtral": "block_sparse_moe"}
EXPERT_PROJECTIONS = {
    "mixtral": {"w1": ("w_gate_up", "gate"), "w3": ("w_gate_up", "up"), "w2": ("w_down", None)},
    "default": {"gate_proj": ("w_gate_up", "gate"), "up_proj": ("w_gate_up", "up"),
                "down_proj": ("w_down", None)},
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder whose sparse layers (``cfg.moe.sparse_layers``) run ``SparseMoeBlock``."""

    STACKED: ClassVar[dict[str, tuple[str, str]]] = {
        **LlamaForCausalLM.STACKED,
        "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate_proj"),
        "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up_proj"),
        "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj", "down_proj"),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod,
                 attention: AttentionBackend, max_model_len: int, *, moe: MoEBackend) -> None:
        if cfg.moe is None:
            raise ModelLoadError(f"model_type {cfg.model_type!r} is not a mixture-of-experts model")
        self.moe_backend = moe  # read by make_mlp while the base class builds the layers
        super().__init__(cfg, dtype, quant, attention, max_model_len)
        self.block_name = BLOCK_NAMES.get(cfg.model_type, "mlp")
        self.projections = EXPERT_PROJECTIONS.get(cfg.model_type, EXPERT_PROJECTIONS["default"])

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype,
                 quant: QuantMethod) -> torch.nn.Module | None:
        return SparseMoeBlock(cfg, dtype, quant, self.moe_backend) if cfg.moe.is_sparse(layer) else None

    def parameter_counts(self) -> tuple[int, int]:
        """(total parameters, parameters a token uses): each token runs top_k of a layer's experts."""
        total = sum(p.numel() for p in self.parameters())
        moe = self.config.moe
        idle = sum(layer.mlp.experts.numel_per_expert * (moe.num_experts - moe.routing.top_k)
                   for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock))
        return total, total - idle

    def weight_target(self, name: str) -> tuple[str, str | None] | tuple[str, str | None, int] | None:
        """As the Llama family's, plus per-expert tensors -> (stacked parameter, shard, expert)."""
        if self.block_name != "mlp":
            name = name.replace(f".{self.block_name}.", ".mlp.")
        match = _EXPERT.fullmatch(name)
        if match is None:
            return super().weight_target(name)
        layer, expert, projection = match.groups()
        if projection not in self.projections:
            return name, None  # reported as unused
        param, shard = self.projections[projection]
        return f"layers.{layer}.mlp.experts.{param}", shard, int(expert)

    def checkpoint_name(self, path: str, shard: str | None, expert: int | None = None) -> str:
        if expert is None:
            name = super().checkpoint_name(path, shard)
        else:
            layer, param = path.split(".")[1], path.rpartition(".")[2]
            projection = next(p for p, target in self.projections.items() if target == (param, shard))
            name = f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
        return name if self.block_name == "mlp" else name.replace(".mlp.", f".{self.block_name}.")
