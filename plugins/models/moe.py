"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE (and DeepSeek's MoE block).

The Llama decoder with some layers' MLP replaced by the kit's ``SparseMoeBlock``
(``lmplug.kit.moe``). Which layers are sparse, and how they route, comes from
``ModelConfig.moe`` (``moe_config.py``).
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from lmplug_models.llama import LlamaForCausalLM

from lmplug.api import AttentionBackend, ModelConfig, MoEBackend, QuantMethod, Unquantized
from lmplug.errors import ModelLoadError
from lmplug.kit.moe import SparseMoeBlock
from lmplug.kit.parallel import ParallelState
from lmplug.kit.sharding import LazyPiece, tensor_shape

# checkpoint names: the MoE block's module name and its experts' projections, per family
BLOCK_NAMES = {"mixtral": "block_sparse_moe", "minimax": "block_sparse_moe"}
EXPERT_PROJECTIONS = {
    "mixtral": {"w1": ("w_gate_up", "gate"), "w3": ("w_gate_up", "up"), "w2": ("w_down", None)},
    "default": {"gate_proj": ("w_gate_up", "gate"), "up_proj": ("w_gate_up", "up"),
                "down_proj": ("w_down", None)},
}
EXPERT_PROJECTIONS["minimax"] = EXPERT_PROJECTIONS["mixtral"]  # MiniMax-Text-01 saves Mixtral's names
# the quantized experts' holders (``ExpertWeights``): stacked parameter -> (holder list, Linear shard)
_HOLDERS = {("w_gate_up", "gate"): ("gate_up_proj", "gate"), ("w_gate_up", "up"): ("gate_up_proj", "up"),
            ("w_down", None): ("down_proj", "down")}
# per-expert tensors (weight; GPTQ/AWQ: qweight, qzeros, scales, g_idx)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.(\w+)")
# transformers >= 5: all experts of a layer in one tensor, gate_up_proj [E, 2I, h], down_proj [E, h, I]
_STACKED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_HOLDER_PATH = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)\.(\d+)\.(\w+)")


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder whose sparse layers (``cfg.moe.sparse_layers``) run ``SparseMoeBlock``.

    Checkpoints name experts one by one (``experts.{e}.w1`` / ``gate_proj`` ..., as
    transformers 4 saves them and quantizers write them) or, as transformers 5 keeps them,
    stacked (``experts.gate_up_proj [E, 2I, h]``, gate rows then up; ``experts.down_proj
    [E, h, I]``); ``split_tensor`` turns the stacked form into the per-expert one.
    """

    LAZY_SPLIT: ClassVar[bool] = True  # split_tensor takes lazy safetensors slices (tensor-parallel loading)
    STACKED: ClassVar[dict[str, tuple[str, str]]] = {
        **LlamaForCausalLM.STACKED,
        "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate_proj"),
        "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up_proj"),
        "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj", "down_proj"),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod,
                 attention: AttentionBackend, max_model_len: int, *, moe: MoEBackend,
                 parallel: ParallelState | None = None) -> None:
        if cfg.moe is None:
            raise ModelLoadError(f"model_type {cfg.model_type!r} is not a mixture-of-experts model")
        self.moe_backend = moe  # read by make_mlp while the base class builds the layers
        super().__init__(cfg, dtype, quant, attention, max_model_len, parallel=parallel)
        self.block_name = BLOCK_NAMES.get(cfg.model_type, "mlp")
        self.projections = EXPERT_PROJECTIONS.get(cfg.model_type, EXPERT_PROJECTIONS["default"])
        self.quantized_experts = not isinstance(quant, Unquantized)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype,
                 quant: QuantMethod) -> torch.nn.Module | None:
        return SparseMoeBlock(cfg, dtype, quant, self.moe_backend, self.tp) if cfg.moe.is_sparse(layer) else None

    def _sparse_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def parameter_counts(self) -> tuple[int, int]:
        """(total parameters, parameters a token uses): each token runs top_k of a layer's experts.
        Experts count as ``E x 3 x h x I`` weights whether stored dense or packed."""
        blocks = self._sparse_blocks()
        expert_params = {id(p) for block in blocks for p in block.experts.parameters()}
        total = sum(p.numel() for p in self.parameters() if id(p) not in expert_params)
        moe = self.config.moe
        total += sum(block.experts.numel_per_expert * moe.num_experts for block in blocks)
        idle = sum(block.experts.numel_per_expert * (moe.num_experts - moe.routing.top_k) for block in blocks)
        return total, total - idle

    def _canonical(self, name: str) -> str:
        return name if self.block_name == "mlp" else name.replace(f".{self.block_name}.", ".mlp.")

    def split_tensor(self, name: str, tensor, layers=None) -> list[tuple[str, torch.Tensor]]:
        """A transformers-5 stacked expert tensor -> the per-expert tensors it holds (views, named
        as this family names them one by one); any other tensor as is. Raises ``ValueError`` for a
        stacked tensor of the wrong shape. Under expert parallelism only the rank's experts are
        returned; a lazy safetensors slice (tensor-parallel loading) gives lazy pieces, so a rank
        reads only its experts (or its slice of each). ``layers``: the decoder layers the names
        number (default this model's; an MTP module's own layer, ``lmplug.kit.mtp``)."""
        layers = self.layers if layers is None else layers
        match = _STACKED_EXPERTS.fullmatch(self._canonical(name))
        layer = int(match[1]) if match else -1
        if match is None or layer >= len(layers) or not isinstance(layers[layer].mlp, SparseMoeBlock):
            return [(name, tensor)]  # not stacked experts (or a dense layer's: reported as unused)
        experts = layers[layer].mlp.experts
        # the checkpoint holds every expert at full width (a rank's share is taken from the pieces)
        num, hidden, inter = self.config.moe.num_experts, experts.hidden, self.config.moe.intermediate_size
        gate_up = match[2] == "gate_up_proj"
        want = (num, 2 * inter, hidden) if gate_up else (num, hidden, inter)
        if tensor_shape(tensor) != want:
            layout = ("[experts, 2 x intermediate (gate rows, then up), hidden]" if gate_up
                      else "[experts, hidden, intermediate]")
            raise ValueError(f"has shape {tensor_shape(tensor)}, the model expects {want} {layout}")
        piece = (lambda e, rows: tensor[e, rows]) if isinstance(tensor, torch.Tensor) else \
            (lambda e, rows: LazyPiece(tensor, e, rows))
        names = {target: projection for projection, target in self.projections.items()}
        prefix = f"model.layers.{layer}.mlp.experts"
        out = []
        for e in range(experts.first_expert, experts.first_expert + experts.num_experts):
            if gate_up:
                out.append((f"{prefix}.{e}.{names['w_gate_up', 'gate']}.weight", piece(e, slice(0, inter))))
                out.append((f"{prefix}.{e}.{names['w_gate_up', 'up']}.weight", piece(e, slice(inter, 2 * inter))))
            else:
                out.append((f"{prefix}.{e}.{names['w_down', None]}.weight", piece(e, slice(0, hidden))))
        return out

    def weight_target(self, name: str) -> tuple[str, str | None] | tuple[str, str | None, int] | None:
        """As the Llama family's, plus per-expert tensors -> (stacked parameter, shard, expert), or
        under a quant method -> (the expert's ``Linear`` holder parameter, its shard)."""
        name = self._canonical(name)
        match = _EXPERT.fullmatch(name)
        if match is None:
            return super().weight_target(name)
        layer, expert, projection, tensor = match.groups()
        if projection not in self.projections:
            return name, None  # reported as unused
        block = self.layers[int(layer)].mlp if int(layer) < len(self.layers) else None
        if isinstance(block, SparseMoeBlock) and int(expert) < self.config.moe.num_experts:
            expert = block.experts.local_index(int(expert))
            if expert is None:  # expert parallel: another rank's expert, not read at all
                return None
        param, shard = self.projections[projection]
        if self.quantized_experts:
            holder, holder_shard = _HOLDERS[param, shard]
            return f"layers.{layer}.mlp.experts.{holder}.{expert}.{tensor}", holder_shard
        if tensor != "weight":
            return name, None  # e.g. a packed tensor without a quant method: reported as unused
        return f"layers.{layer}.mlp.experts.{param}", shard, int(expert)

    def _first_expert(self, layer: str) -> int:
        """The checkpoint id of the first expert layer ``layer`` holds (non-zero under expert parallelism)."""
        return self.layers[int(layer)].mlp.experts.first_expert

    def checkpoint_name(self, path: str, shard: str | None, expert: int | None = None) -> str:
        holder = _HOLDER_PATH.fullmatch(path)
        if holder is not None:
            layer, kind, expert_id, tensor = holder.groups()
            expert_id = int(expert_id) + self._first_expert(layer)  # the checkpoint's expert id
            param, param_shard = next(k for k, v in _HOLDERS.items() if v == (kind, shard))
            projection = next(p for p, target in self.projections.items() if target == (param, param_shard))
            name = f"model.layers.{layer}.mlp.experts.{expert_id}.{projection}.{tensor}"
        elif expert is None:
            name = super().checkpoint_name(path, shard)
        else:
            layer, param = path.split(".")[1], path.rpartition(".")[2]
            projection = next(p for p, target in self.projections.items() if target == (param, shard))
            name = f"model.layers.{layer}.mlp.experts.{expert + self._first_expert(layer)}.{projection}.weight"
        return name if self.block_name == "mlp" else name.replace(".mlp.", f".{self.block_name}.")
