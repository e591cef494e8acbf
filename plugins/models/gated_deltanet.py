"""Qwen3-Next's gated DeltaNet mixer (transformers' ``Qwen3NextGatedDeltaNet``).

With ``Hk`` query/key heads of width ``Dk``, ``Hv = r Hk`` value heads of width ``Dv``::

    q, k, v, z = in_proj_qkvz(h)      interleaved per key head: [Hk, (Dk, Dk, r Dv, r Dv)]
    b, a       = in_proj_ba(h)        interleaved per key head: [Hk, (r, r)]
    q, k, v    = silu(causal_conv1d(cat(q, k, v)))   depthwise, kernel K, no bias
    g    = -exp(A_log) * softplus(a + dt_bias)        log decay per value head (fp32)
    beta = sigmoid(b)
    o    = gated_delta_rule(q, k, v, g, beta)         q, k L2-normalised, q scaled by Dk^-0.5
    out  = out_proj(RMSNorm(o) * weight * silu(z))    normalised per value head, then gated

(Yang et al., "Gated Delta Networks", 2024.) The interleaved layouts are transformers'
``fix_query_key_value_ordering``, reproduced here on the fly. Each layer keeps two state tensors
per sequence: ``conv`` [2 Hk Dk + Hv Dv, K - 1] in the model dtype and ``recurrent`` [Hv, Dk, Dv]
in fp32. The ops run through the mixer backend (``lmplug.interfaces.mixer``), decode rows and
prefill chunks apart (``state_layers``).

Tensor parallelism (N ranks, N dividing Hk): rank r holds key heads ``[r Hk/N, (r+1) Hk/N)`` and
the value heads that follow them. The interleaved layouts are per key head, so its rows of both
input projections are one range each; its conv channels are three ranges (its q, k and v), its
dt_bias and A_log its value heads; the norm (per value head) is whole, out_proj split by rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmplug.api import (
    ConfigReader,
    MixerBackend,
    ModelConfig,
    QuantMethod,
    StateTensor,
    StepContext,
)
from lmplug.kit.parallel import ParallelState
from lmplug.kit.parallel_layers import column_linear, row_linear
from lmplug.kit.rope import RotaryEmbedding
from lmplug.kit.sharding import RangeShard
from lmplug.kit.state_layers import StateRows, run_split

CHUNK_SIZE = 64  # the chunked scan's block (transformers' torch_chunk_gated_delta_rule default)


class GatedDeltaFacts:
    """The gated DeltaNet keys of a Qwen3-Next config.json (types and bounds checked)."""

    def __init__(self, cfg: ModelConfig, world_size: int = 1) -> None:
        r = ConfigReader(cfg.raw, "config.json")
        self.num_k_heads = r.int("linear_num_key_heads")
        self.num_v_heads = r.int("linear_num_value_heads")
        self.head_k_dim = r.int("linear_key_head_dim")
        self.head_v_dim = r.int("linear_value_head_dim")
        self.conv_kernel = r.int("linear_conv_kernel_dim", 4, high=64)
        if self.conv_kernel < 2:
            r.fail("linear_conv_kernel_dim", f"must be at least 2, got {self.conv_kernel}")
        if self.num_v_heads % self.num_k_heads:
            r.fail("linear_num_value_heads", f"({self.num_v_heads}) must be a multiple of "
                   f"linear_num_key_heads ({self.num_k_heads})")
        if cfg.hidden_act not in ("silu", "swish"):
            r.fail("hidden_act", f"is {cfg.hidden_act!r}; the gated DeltaNet's conv activation is silu")
        if self.num_k_heads % world_size:
            r.fail("linear_num_key_heads", f"({self.num_k_heads}) must be divisible by "
                   f"parallel.tensor_parallel_size ({world_size}): each rank holds whole key heads")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.group = self.num_v_heads // self.num_k_heads  # value heads per key head


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen3NextRMSNormGated``: ``weight * RMSNorm(o)`` over the last dim (fp32,
    cast back before the weight), then times ``silu(gate)`` in fp32; the norm comes before the gate."""
    of = o.float()
    normed = weight * (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return (normed * F.silu(gate.float())).to(o.dtype)


class GatedDeltaNet(torch.nn.Module, RangeShard):
    """``forward(h [T, hidden], positions, rope, pools, ctx) -> [T, hidden]``; ``pools`` are this
    layer's state pools (``{"conv": [slots, C, K-1], "recurrent": [slots, Hv, Dk, Dv]}``, this
    rank's heads under tensor parallelism; ``tp_ranges``: the rows of the conv and per-head
    parameters it holds)."""

    def __init__(self, cfg: ModelConfig, facts: GatedDeltaFacts, state_index: int, dtype: torch.dtype,
                 quant: QuantMethod, mixer: MixerBackend, tp: ParallelState) -> None:
        super().__init__()
        self.cfg, self.facts, self.state_index, self.ops = cfg, facts, state_index, mixer
        f = facts
        k0, self.num_k_heads = tp.split(f.num_k_heads)  # this rank's key heads; their value heads follow
        v0, self.num_v_heads = k0 * f.group, self.num_k_heads * f.group
        self.key_dim, self.value_dim = self.num_k_heads * f.head_k_dim, self.num_v_heads * f.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        per_head = 2 * f.head_k_dim + 2 * f.group * f.head_v_dim  # qkvz rows of one key head
        # both input projections read h: one matmul, the checkpoint's two tensors as shards
        self.in_proj = column_linear(cfg.hidden_size, {
            "in_proj_qkvz": (k0 * per_head, self.num_k_heads * per_head),
            "in_proj_ba": (2 * f.group * k0, 2 * self.num_v_heads)}, bias=False, dtype=dtype, quant=quant, tp=tp)
        q0, v_rows = k0 * f.head_k_dim, (2 * f.key_dim + v0 * f.head_v_dim, self.value_dim)
        self.tp_ranges = {"conv_weight": ((q0, self.key_dim), (f.key_dim + q0, self.key_dim), v_rows),
                          "dt_bias": ((v0, self.num_v_heads),), "A_log": ((v0, self.num_v_heads),)}
        # checkpoint layout [C, 1, K] (nn.Conv1d, depthwise); the ops read [C, K]
        self.conv_weight = _param(self.conv_dim, 1, f.conv_kernel, dtype=dtype)
        self.dt_bias = _param(self.num_v_heads, dtype=dtype)
        self.A_log = _param(self.num_v_heads, dtype=dtype)
        self.norm_weight = _param(f.head_v_dim, dtype=dtype)
        self.out_proj = row_linear(f.value_dim, {"out_proj": cfg.hidden_size}, bias=False, dtype=dtype,
                                   quant=quant, tp=tp)

    def state_tensors(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        f = self.facts
        return (StateTensor("conv", (self.conv_dim, f.conv_kernel - 1), dtype),
                StateTensor("recurrent", (self.num_v_heads, f.head_k_dim, f.head_v_dim), torch.float32))

    def split_projections(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """transformers' ``fix_query_key_value_ordering``: h [T, hidden] -> the conv input
        cat(q, k, v) [T, C], z [T, Hv, Dv], b and a [T, Hv]."""
        f, hk, hv = self.facts, self.num_k_heads, self.num_v_heads
        qkvz, ba = self.in_proj(h).split([2 * self.key_dim + 2 * self.value_dim, 2 * hv], dim=-1)
        n = h.shape[0]
        rdv = f.group * f.head_v_dim
        # [T, Hk, (Dk, Dk, r Dv, r Dv)] and [T, Hk, (r, r)]
        q, k, v, z = qkvz.reshape(n, hk, -1).split([f.head_k_dim, f.head_k_dim, rdv, rdv], dim=-1)
        b, a = ba.reshape(n, hk, -1).split([f.group, f.group], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)  # [T, C]
        return mixed, z.reshape(n, hv, f.head_v_dim), b.reshape(n, hv), a.reshape(n, hv)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                pools: dict[str, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        f, ops = self.facts, self.ops
        rows = StateRows.of(ctx)
        mixed, z, b, a = self.split_projections(h)
        weight = self.conv_weight.squeeze(1)
        conv, state = pools["conv"], pools["recurrent"]
        mixed = run_split(
            rows,
            lambda s: ops.conv1d_update(mixed[s], weight, None, conv, rows.decode_slots),
            lambda s: ops.conv1d_scan(mixed[s], weight, None, rows.prefill_cu, conv, rows.prefill_slots))
        n = h.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(n, self.num_k_heads, f.head_k_dim).contiguous()
        k = k.reshape(n, self.num_k_heads, f.head_k_dim).contiguous()
        v = v.reshape(n, self.num_v_heads, f.head_v_dim).contiguous()
        beta = b.sigmoid().contiguous()
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).contiguous()  # fp32 [T, Hv]
        o = run_split(
            rows,
            lambda s: ops.gated_delta_update(q[s], k[s], v[s], g[s], beta[s], state, rows.decode_slots),
            lambda s: ops.gated_delta_scan(q[s], k[s], v[s], g[s], beta[s], rows.prefill_cu, state,
                                           rows.prefill_slots, chunk_size=CHUNK_SIZE))
        o = gated_rms_norm(o, z, self.norm_weight, self.cfg.rms_norm_eps)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(n, self.value_dim))


def _param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
