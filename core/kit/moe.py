"""The mixture-of-experts block: a router, every expert's weights stacked along a leading ``E``
axis, and optionally an always-on shared expert (Qwen2-MoE gates it by a sigmoid, DeepSeek adds it
as is). The block asks its moe backend to route and to run the experts; it does not know which
backend it got. Which layers are sparse, and how they route, comes from ``ModelConfig.moe``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmplug.errors import ModelLoadError
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.moe import MoEBackend
from lmplug.interfaces.quant import QuantMethod, Unquantized
from lmplug.kit.decoder import MLP
from lmplug.kit.layers import Linear
from lmplug.kit.parallel import ParallelState, single


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
