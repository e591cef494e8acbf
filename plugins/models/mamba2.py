"""Mamba2 (``Mamba2ForCausalLM``): a pure state-space model, every layer an SSD mixer.

A block is ``x + mixer(RMSNorm(x))``; the mixer (Dao & Gu 2024, transformers' ``Mamba2Mixer``):

    z, xBC, dt = in_proj(h)                      widths I, I + 2 G N, H   (I = expand * hidden)
    xBC = silu(causal_conv1d(xBC))               depthwise, kernel K, state: the last K - 1 inputs
    x, B, C = xBC                                x [H, P], B and C [G, N]
    y = SSD(x, dt, A = -exp(A_log), B, C, D, dt_bias)      state [H, P, N] fp32
    out = out_proj(RMSNormGated(y, z))           y * silu(z), normalised in G groups of I / G

Each layer keeps two state tensors per sequence (``state_specs``): ``conv`` [I + 2GN, K - 1] in
the model dtype and ``ssm`` [H, P, N] in fp32. The ops run through the mixer backend
(``lmplug.interfaces.mixer``), decode rows and prefill chunks apart (``state_layers``).
Checkpoint names are transformers': ``backbone.embeddings``, ``backbone.layers.N.{norm, mixer.*}``,
``backbone.norm_f``, ``lm_head``.

Tensor parallelism (N ranks): rank r holds heads ``[r H/N, (r+1) H/N)`` (their x, z, dt, A, D,
dt_bias, inner channels and norm weight), B and C's groups split when N divides G, else the one
group its heads read (N a multiple of G; heads map to groups by ``h // (H/G)``, so a rank's heads
share one), out_proj split by rows (one all-reduce). in_proj's rank columns are five ranges of the
checkpoint tensor ([z | x | B | C | dt]), the conv's rows three ([x | B | C]): ``RangeShard``. A
norm group (I/G channels) spread over N/G ranks sums its squares over them (one all-reduce). The
vocabulary is split as in the Llama family. Each rank zeroes the state slots of the sequences a
step starts (``state_layers.zero_fresh_states``: only rank 0's KV cache hands slots out).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from lmplug.api import (
    MAMBA2,
    ConfigReader,
    MixerBackend,
    ModelConfig,
    QuantMethod,
    StateSpec,
    StateTensor,
    StepContext,
)
from lmplug.errors import ModelLoadError
from lmplug.kit.layers import Linear, RMSNorm
from lmplug.kit.parallel import ParallelState, single
from lmplug.kit.parallel_layers import embedding, row_linear
from lmplug.kit.pipeline import foreign_layer, stage_input, stage_layers, stage_output
from lmplug.kit.sharding import Ranges, RangeShard
from lmplug.kit.state_layers import StateRows, run_split, zero_fresh_states


class Mamba2Facts:
    """The SSM keys of a Mamba2 config.json (types and bounds checked)."""

    def __init__(self, cfg: ModelConfig, world_size: int = 1) -> None:
        r = ConfigReader(cfg.raw, "config.json")
        self.state_size = r.int("state_size")
        self.n_groups = r.int("n_groups", 1)
        self.conv_kernel = r.int("conv_kernel", 4, high=64)
        self.chunk_size = r.int("chunk_size", 256, high=1 << 16)
        self.use_conv_bias = r.flag("use_conv_bias", True)
        self.use_bias = r.flag("use_bias", False)
        self.residual_in_fp32 = r.flag("residual_in_fp32", True)
        limit = cfg.raw.get("time_step_limit", (0.0, math.inf))
        values = [_number(v) for v in limit] if isinstance(limit, (list, tuple)) else []
        if len(values) != 2 or None in values or math.isnan(values[0]) or values[0] > values[1]:
            r.fail("time_step_limit", f"must be two numbers [min, max], min <= max, got {limit!r}")
        self.dt_limit = (values[0], values[1])
        if cfg.intermediate_size % self.n_groups or cfg.num_heads % self.n_groups:
            r.fail("n_groups", f"({self.n_groups}) must divide num_heads ({cfg.num_heads}) and the inner "
                   f"width ({cfg.intermediate_size})")
        if cfg.hidden_act not in ("silu", "swish"):
            r.fail("hidden_act", f"is {cfg.hidden_act!r}; Mamba2's conv activation is silu")
        if self.n_groups % world_size and world_size % self.n_groups:
            r.fail("n_groups", f"({self.n_groups}) must divide parallel.tensor_parallel_size ({world_size}) "
                   "or be a multiple of it (each rank holds whole B/C groups)")
        self.conv_dim = cfg.intermediate_size + 2 * self.n_groups * self.state_size


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int,
                   eps: float) -> torch.Tensor:
    """Mamba2's ``RMSNormGated``: ``y * silu(gate)``, normalised over each of ``groups`` equal
    slices of the last dim (fp32), times ``weight``."""
    h = y.float() * F.silu(gate.float())
    g = h.view(*h.shape[:-1], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(h.shape).to(y.dtype)


def gated_rms_norm_shared(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          tp: ParallelState, group: int, groups: int, width: int) -> torch.Tensor:
    """``gated_rms_norm`` of a rank that holds part of norm group ``group`` (``width`` channels in
    all, spread over several ranks): each rank's sum of squares goes in its group's column of a
    [T, groups] table, zeros elsewhere, and one all-reduce gives every group's total."""
    h = y.float() * F.silu(gate.float())
    sums = h.new_zeros(h.shape[0], groups)
    sums[:, group] = h.pow(2).sum(-1)
    tp.all_reduce(sums)
    h = h * torch.rsqrt(sums[:, group:group + 1] / width + eps)
    return weight * h.to(y.dtype)


class RangeParallelLinear(Linear, RangeShard):
    """A ``Linear`` whose one checkpoint shard is read as several ranges of its output features
    (``tp_ranges``: shard name -> ranges; the layer's size is theirs summed)."""

    def __init__(self, in_features: int, shard: str, ranges: Ranges, *, bias: bool, dtype: torch.dtype,
                 quant: QuantMethod) -> None:
        super().__init__(in_features, {shard: sum(size for _, size in ranges)}, bias=bias, dtype=dtype,
                         quant=quant)
        self.tp_ranges = {shard: ranges}


class Mamba2Mixer(torch.nn.Module, RangeShard):
    """Under tensor parallelism: this rank's heads and B/C groups (module docstring); ``tp_ranges``
    names the rows of the conv and of the per-head and per-channel parameters it holds."""

    def __init__(self, cfg: ModelConfig, ssm: Mamba2Facts, state_index: int, dtype: torch.dtype,
                 quant: QuantMethod, mixer: MixerBackend, tp: ParallelState) -> None:
        super().__init__()
        self.cfg, self.ssm, self.state_index, self.ops, self.tp = cfg, ssm, state_index, mixer, tp
        inner, heads, n, groups = cfg.intermediate_size, cfg.num_heads, ssm.state_size, ssm.n_groups
        head0, self.heads = tp.split(heads)
        inner0, self.inner = tp.split(inner)
        self.group0, self.groups = tp.kv_heads(groups)  # whole groups, or the one this rank's heads read
        bc0, bc = self.group0 * n, self.groups * n
        self.conv_dim = self.inner + 2 * bc
        # a norm group (inner / G channels) wider than this rank's channels: its squares are summed over ranks
        self.norm_shared = tp.world_size > groups
        conv_rows = ((inner0, self.inner), (inner + bc0, bc), (inner + groups * n + bc0, bc))
        self.in_proj = RangeParallelLinear(
            cfg.hidden_size, "in_proj",
            ((inner0, self.inner), *((inner + start, size) for start, size in conv_rows),
             (inner + ssm.conv_dim + head0, self.heads)),
            bias=ssm.use_bias, dtype=dtype, quant=quant)
        head_rows = ((head0, self.heads),)
        self.tp_ranges = {"conv_weight": conv_rows, "conv_bias": conv_rows, "dt_bias": head_rows,
                          "A_log": head_rows, "D": head_rows, "norm_weight": ((inner0, self.inner),)}
        # checkpoint layout [C, 1, K] (nn.Conv1d, depthwise); the ops read [C, K]
        self.conv_weight = _param(self.conv_dim, 1, ssm.conv_kernel, dtype=dtype)
        self.conv_bias = _param(self.conv_dim, dtype=dtype) if ssm.use_conv_bias else None
        self.dt_bias = _param(self.heads, dtype=dtype)
        self.A_log = _param(self.heads, dtype=dtype)
        self.D = _param(self.heads, dtype=dtype)
        self.norm_weight = _param(self.inner, dtype=dtype)
        self.out_proj = row_linear(inner, {"out_proj": cfg.hidden_size}, bias=ssm.use_bias, dtype=dtype,
                                   quant=quant, tp=tp)

    def state_tensors(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        return (StateTensor("conv", (self.conv_dim, self.ssm.conv_kernel - 1), dtype),
                StateTensor("ssm", (self.heads, self.cfg.head_dim, self.ssm.state_size), torch.float32))

    def forward(self, h: torch.Tensor, rows: StateRows, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg, ssm, ops = self.cfg, self.ssm, self.ops
        inner, heads, groups, n = self.inner, self.heads, self.groups, ssm.state_size
        z, xbc, dt = self.in_proj(h).split([inner, self.conv_dim, heads], dim=-1)
        weight = self.conv_weight.squeeze(1)
        conv, state = pools["conv"], pools["ssm"]
        xbc = run_split(
            rows,
            lambda s: ops.conv1d_update(xbc[s], weight, self.conv_bias, conv, rows.decode_slots),
            lambda s: ops.conv1d_scan(xbc[s].contiguous(), weight, self.conv_bias, rows.prefill_cu, conv,
                                      rows.prefill_slots))
        x, B, C = xbc.split([inner, groups * n, groups * n], dim=-1)
        x = x.reshape(-1, heads, cfg.head_dim)  # [T, H, P] (this rank's heads)
        B, C = B.reshape(-1, groups, n), C.reshape(-1, groups, n)  # [T, G, N] (this rank's groups)
        A = -torch.exp(self.A_log.float())
        dt = dt.contiguous()
        kw = {"dt_bias": self.dt_bias, "dt_softplus": True, "dt_limit": ssm.dt_limit}
        y = run_split(
            rows,
            lambda s: ops.ssd_update(x[s], dt[s], A, B[s], C[s], self.D, state, rows.decode_slots, **kw),
            lambda s: ops.ssd_scan(x[s], dt[s], A, B[s], C[s], self.D, rows.prefill_cu, state,
                                   rows.prefill_slots, chunk_size=ssm.chunk_size, **kw))
        y = y.reshape(-1, inner)
        if self.norm_shared:
            y = gated_rms_norm_shared(y, z, self.norm_weight, cfg.rms_norm_eps, self.tp, self.group0,
                                      ssm.n_groups, cfg.intermediate_size // ssm.n_groups)
        else:
            y = gated_rms_norm(y, z, self.norm_weight, groups, cfg.rms_norm_eps)
        return self.out_proj(y)


class Mamba2Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, ssm: Mamba2Facts, state_index: int, dtype: torch.dtype,
                 quant: QuantMethod, mixer: MixerBackend, tp: ParallelState) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mixer = Mamba2Mixer(cfg, ssm, state_index, dtype, quant, mixer, tp)
        self.residual_in_fp32 = ssm.residual_in_fp32

    def forward(self, x: torch.Tensor, rows: StateRows, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.mixer(self.norm(x), rows, pools)
        if self.residual_in_fp32 and x.dtype != torch.float32:
            return (x.float() + out.float()).to(x.dtype)
        return x + out


class Mamba2ForCausalLM(torch.nn.Module):
    """``forward(input_ids [T], positions [T], ctx) -> hidden [T, h]``; the state pools come from
    the KV cache (``bind_states``)."""

    # lmplug embeddings: forward returns the final-norm hidden states, which pooling reads
    final_hidden_states = True
    pipeline_stages = True  # each stage holds its layers and their states (``parallel.stage``)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod, attention,
                 max_model_len: int, *, parallel: ParallelState | None = None,
                 mixer: MixerBackend | None = None) -> None:
        super().__init__()
        if mixer is None:
            raise ModelLoadError("mamba2: the model's SSD layers need a mixer backend (`mixer:` section)")
        self.config = cfg
        self.dtype = dtype
        self.tp = parallel or single()  # tensor parallel: heads split, the vocabulary split in rows
        ssm = Mamba2Facts(cfg, self.tp.world_size)
        stage = self.tp.stage  # pipeline parallel: the embedding first, this stage's layers, the head last
        self.embed_tokens = (embedding(cfg.vocab_size, cfg.hidden_size, dtype, self.tp)
                             if stage.first or (stage.last and cfg.tie_word_embeddings) else None)
        self.layers = stage_layers(stage, cfg.num_layers,
                                   lambda i: Mamba2Block(cfg, ssm, i, dtype, quant, mixer, self.tp))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.last else None
        vocab_rows = self.tp.vocab_range(cfg.vocab_size)[1]
        self.lm_head = (None if cfg.tie_word_embeddings or not stage.last
                        else _param(vocab_rows, cfg.hidden_size, dtype=dtype))
        self.state_pools: list[dict[str, torch.Tensor]] = []

    def state_specs(self) -> tuple[StateSpec, ...]:
        return tuple(StateSpec(i, MAMBA2, block.mixer.state_tensors(self.dtype))
                     for i, block in enumerate(self.layers) if self.tp.stage.owns(i))

    def bind_kv(self, views: list) -> None:
        if views:
            raise RuntimeError(f"mamba2 has no attention layers; got {len(views)} KV layer views")

    def bind_states(self, pools: list[dict[str, torch.Tensor]]) -> None:
        self.state_pools = pools

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        rows = StateRows.of(ctx)
        if self.tp.is_distributed:  # the slots rank 0's KV cache zeroed when it handed them out
            zero_fresh_states([p for p in self.state_pools if p is not None], ctx)
        x = stage_input(self.tp, self.embed_tokens, input_ids, self.config.hidden_size, self.dtype)
        for layer, pools in zip(self.layers, self.state_pools, strict=True):
            x = layer(x, rows, pools)
        return stage_output(self.tp, x, self.norm)  # None: a pipeline stage before the last

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, head)  # [N, V] (tensor parallel: [N, V / N] per rank)
        if not self.tp.is_parallel:
            return logits
        full = self.tp.gather_last_dim(logits)  # rank 0: every rank's vocabulary slice; others: None
        return None if full is None else full[:, :self.config.vocab_size]

    # -- checkpoint names ---------------------------------------------------------------------
    _PARAMS: ClassVar[dict[str, str]] = {"mixer.conv1d.weight": "mixer.conv_weight", "mixer.conv1d.bias": "mixer.conv_bias",
                                         "mixer.norm.weight": "mixer.norm_weight"}
    _LINEARS: ClassVar[dict[str, str]] = {"mixer.in_proj": "in_proj", "mixer.out_proj": "out_proj"}

    def skips_tensor(self, name: str) -> bool:
        """A tensor of a layer another pipeline stage holds (the loader never reads it)."""
        return foreign_layer(self.tp.stage, name, "backbone.layers.")

    def weight_target(self, name: str) -> tuple[str, str | None] | None:
        if name.startswith("backbone.layers."):
            idx, _, tail = name[len("backbone.layers."):].partition(".")
            module = tail.rpartition(".")[0]
            if module in self._LINEARS:
                return f"layers.{idx}.{tail}", self._LINEARS[module]
            return f"layers.{idx}.{self._PARAMS.get(tail, tail)}", None
        if name in ("backbone.embeddings.weight", "backbone.embedding.weight"):
            return "embed_tokens.weight", None
        if name == "backbone.norm_f.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return None if self.lm_head is None else ("lm_head", None)
        return name, None

    def checkpoint_name(self, path: str, shard: str | None) -> str:
        if path.startswith("layers."):
            idx, _, tail = path[len("layers."):].partition(".")
            inverse = {v: k for k, v in self._PARAMS.items()}
            return f"backbone.layers.{idx}.{inverse.get(tail, tail)}"
        return {"embed_tokens.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight",
                "lm_head": "lm_head.weight"}.get(path, path)


def _number(value) -> float | None:
    """A JSON number, or transformers' spelling of a non-finite one (``{"__float__": "Infinity"}``)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = {"Infinity": math.inf, "-Infinity": -math.inf}.get(value["__float__"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
