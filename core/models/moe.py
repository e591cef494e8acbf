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
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.moe import MoEBackend
from lmplug.interfaces.quant import QuantMethod, Unquantized
from lmplug.models.layers import Linear
from lmplug.models.llama import MLP, LlamaForCausalLM
from lmplug.parallel import ParallelState, single
from lmplug.parallel.sharding import LazyPiece, tensor_shape


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
    """Every expert's SwiGLU weights: ``w_gate_up [E, 2I, h]`` (gate rows, then up), ``w_down [E, h, I]``.

    Under expert parallelism a rank holds ``num_experts`` whole experts starting at the model's
    expert ``first_expert`` (index ``e`` here is expert ``first_expert + e`` of the checkpoint);
    otherwise ``first_expert`` is 0 and, under tensor parallelism, ``intermediate`` is the rank's
    slice of every expert's width.

    Unquantized, the two stacked parameters are filled expert by expert at load.
    Under a quant method, each expert's projections are ``Linear`` holders instead
    (``gate_up_proj[e]``, shards ``gate``/``up``; ``down_proj[e]``, shard ``down``),
    so the method creates, loads, quantizes and computes them exactly as a dense
    layer's (RTN rounds each expert per group; GPTQ/AWQ read each expert's packed
    tensors) and this module knows no format. After loading, experts the method
    left as a plain float ``weight`` (the weight-only methods' default for experts,
    on CPU and CUDA alike) are stacked into the two parameters and the holders
    dropped, so every backend runs them; experts it keeps packed
    (``dequantize_at_load: false``, W8A8 methods) stay holders, which a backend with
    the ``packed_experts`` feature calls per expert (``experts_args``).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 quant: QuantMethod | None = None, first_expert: int = 0) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.first_expert = first_expert
        self.quantized = quant is not None and not isinstance(quant, Unquantized)
        if self.quantized:
            self.gate_up_proj = torch.nn.ModuleList(
                _expert_linear(hidden, {"gate": intermediate, "up": intermediate}, dtype, quant)
                for _ in range(num_experts))
            self.down_proj = torch.nn.ModuleList(
                _expert_linear(intermediate, {"down": hidden}, dtype, quant) for _ in range(num_experts))
        else:
            self.w_gate_up = _param(num_experts, 2 * intermediate, hidden, dtype=dtype)
            self.w_down = _param(num_experts, hidden, intermediate, dtype=dtype)

    @property
    def numel_per_expert(self) -> int:
        """Weights of one expert (gate, up, down), whatever their storage."""
        return 3 * self.hidden * self.intermediate

    @property
    def packed(self) -> bool:
        """True while the experts are quant-method holders rather than stacked dense tensors."""
        return hasattr(self, "gate_up_proj")

    def experts_args(self) -> tuple:
        """What ``MoEBackend.experts`` takes as ``(w_gate_up, w_down)``."""
        if self.packed:
            return self.gate_up_proj, self.down_proj
        return self.w_gate_up, self.w_down

    def stack_dense(self) -> None:
        """After loading: holders that ended as plain float weights become the stacked parameters."""
        if not self.packed or not all(_is_dense(m) for m in (*self.gate_up_proj, *self.down_proj)):
            return
        self.w_gate_up = torch.nn.Parameter(torch.stack([m.weight.data for m in self.gate_up_proj]),
                                            requires_grad=False)
        del self.gate_up_proj
        self.w_down = torch.nn.Parameter(torch.stack([m.weight.data for m in self.down_proj]),
                                         requires_grad=False)
        del self.down_proj

    def shard_range(self, shard: str) -> tuple[int, int]:
        inter = self.intermediate
        return {"gate": (0, inter), "up": (inter, 2 * inter)}[shard]

    def local_index(self, expert: int) -> int | None:
        """The index here of the checkpoint's expert ``expert``; None when another rank holds it."""
        local = expert - self.first_expert
        return local if 0 <= local < self.num_experts else None

    def checkpoint_pieces(self, param: str) -> list[tuple[str | None, int]]:
        """(shard, local expert) of each checkpoint tensor that fills ``param``."""
        shards = ("gate", "up") if param == "w_gate_up" else (None,)
        return [(shard, e) for e in range(self.num_experts) for shard in shards]


def _expert_linear(n_in: int, shards: dict[str, int], dtype: torch.dtype, quant: QuantMethod) -> Linear:
    layer = Linear(n_in, shards, bias=False, dtype=dtype, quant=quant)
    layer.moe_expert = True  # quant methods: no grouped kernel reads packed experts, prefer dense
    return layer


def _is_dense(layer: Linear) -> bool:
    """The quant method left a plain float ``weight [out, in]`` and nothing else."""
    names = {name for name, _ in layer.named_parameters()} | {name for name, _ in layer.named_buffers()}
    weight = getattr(layer, "weight", None)
    return (names == {"weight"} and weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and tuple(weight.shape) == (layer.out_features, layer.in_features))


class SparseMoeBlock(torch.nn.Module):
    """Routed experts (+ a shared expert): x [T, h] -> [T, h].

    Tensor parallel: each rank holds a 1/N slice of every expert's width, or under expert
    parallelism whole experts ``[rank*E/N, (rank+1)*E/N)``, of which it runs only the token-expert
    pairs routed to them (the others' routing weights are dropped here, so backends never see a
    non-local expert). Either way each rank's routed output is a partial sum, all-reduced once.
    The router is replicated; a shared expert is split by its width like any MLP.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod, backend: MoEBackend,
                 tp: ParallelState | None = None) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ModelLoadError(f"a {cfg.model_type!r} model has no MoE configuration")
        self.routing = moe.routing
        self.backend = backend
        self.gate = Gate(cfg.hidden_size, moe.num_experts, dtype, correction_bias=moe.correction_bias)
        self.tp = tp or single()  # tensor parallel: a slice of every expert's width, or whole experts
        self.expert_parallel = self.tp.is_parallel and self.tp.expert_parallel
        first, local = self.tp.expert_range(moe.num_experts)
        self.experts = ExpertWeights(local, cfg.hidden_size, self.tp.expert_width(moe.intermediate_size),
                                     dtype, quant, first_expert=first)
        self.shared_expert = (MLP(cfg, dtype, quant, intermediate_size=moe.shared_intermediate_size, tp=self.tp)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = Gate(cfg.hidden_size, 1, dtype) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E]
        ids, weights = self.backend.route(logits, self.routing,
                                          correction_bias=self.gate.e_score_correction_bias)  # [T, k]
        if self.expert_parallel:
            routed = self._local_experts(x, ids, weights)
        else:
            routed = self.backend.experts(x, ids, weights, *self.experts.experts_args())
        out = self.tp.all_reduce(routed)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert parallel: the routed output of this rank's experts only, [T, h]. The pairs whose
        expert is local go to the backend as one row each (x of their token, the local expert id,
        its weight: k = 1), so every backend runs them unchanged; the rows are summed per token."""
        local = ids - self.experts.first_expert
        tokens, slots = ((local >= 0) & (local < self.experts.num_experts)).nonzero(as_tuple=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if tokens.numel():
            rows = self.backend.experts(x[tokens], local[tokens, slots].unsqueeze(1),
                                        weights[tokens, slots].unsqueeze(1), *self.experts.experts_args())
            out.index_add_(0, tokens, rows.float())
        return out.to(x.dtype)

    def after_loading(self) -> None:
        """Called by the loader once every ``Linear`` is processed: stack dense experts, and
        refuse packed ones a backend cannot run."""
        self.experts.stack_dense()
        if self.experts.packed and "packed_experts" not in self.backend.capabilities.features:
            raise ModelLoadError(
                f"moe backend {self.backend.name!r} runs stacked dense experts only, and quant method "
                f"{self.experts.gate_up_proj[0].quant.name!r} keeps the experts packed (as with "
                "`dequantize_at_load: false`); use `moe: reference`, or let the method dequantize them "
                "at load (drop `dequantize_at_load: false`)")


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
        number (default this model's; an MTP module's own layer, ``lmplug.models.mtp``)."""
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
