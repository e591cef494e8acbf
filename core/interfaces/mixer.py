"""Mixer backends: the sequence-mixing ops of linear-attention and state-space layers.

A model with state layers (``lmplug.interfaces.state``) calls these ops through the backend the
config chose (``mixer: {backend: auto | torch | triton}``), as attention layers call their
attention backend. Every op works on the step's flattened tokens and the state pools in place:

- ``*_scan`` ops run prefill and chunked-prefill rows: tokens of B sequences flattened along dim 0
  (``cu_seqlens [B+1]``, int32/int64), each sequence starting from the state in its slot
  (``state_indices [B]`` rows of the pool; a fresh sequence's slot holds zeros) and leaving its
  final state there;
- ``*_update`` ops run decode rows: one token per sequence (``[B, ...]``), the state updated in place.

Pools: ``conv_state [num_slots, C, K-1]`` (the last K-1 inputs of a causal depthwise
convolution, model dtype), SSM / linear-attention states ``[num_slots, H, ...]`` in float32.

The math of each op, and its reference, is the first-party ``torch`` backend's (pure PyTorch,
the CPU default and the ground truth); the ``triton`` backend runs chunked-parallel Triton
kernels. Both compute in fp32 and return outputs in the input's dtype.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities


class MixerBackend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    # -- causal depthwise conv1d (Mamba2, gated DeltaNet) ------------------------------------
    @abstractmethod
    def conv1d_scan(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    cu_seqlens: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                    activation: str | None = "silu") -> torch.Tensor:
        """x [T, C], weight [C, K], bias [C] -> y [T, C]: ``y_t = act(bias + sum_j w[:, j] x_{t-K+1+j})``
        with inputs before a sequence's first token read from its conv state (then updated)."""

    @abstractmethod
    def conv1d_update(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, state_indices: torch.Tensor,
                      activation: str | None = "silu") -> torch.Tensor:
        """One token per sequence: x [B, C] -> y [B, C], the conv state rolled in place."""

    # -- Mamba2's SSD --------------------------------------------------------------------------
    @abstractmethod
    def ssd_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor | None, cu_seqlens: torch.Tensor, state: torch.Tensor,
                 state_indices: torch.Tensor, *, chunk_size: int, dt_bias: torch.Tensor | None = None,
                 dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
        """x [T, H, P], dt [T, H], A [H], B and C [T, G, N], D [H]; state pool [slots, H, P, N]
        fp32 -> y [T, H, P]. ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``,
        dt discretized as ``clamp(softplus(dt + dt_bias), *dt_limit)``."""

    @abstractmethod
    def ssd_update(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None, state: torch.Tensor, state_indices: torch.Tensor,
                   *, dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                   dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
        """One token per sequence: x [B, H, P], dt [B, H], B and C [B, G, N] -> y [B, H, P]."""

    # -- the gated delta rule (Qwen3-Next's gated DeltaNet) ------------------------------------
    @abstractmethod
    def gated_delta_scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                         state_indices: torch.Tensor, *, chunk_size: int = 64, use_qk_l2norm: bool = True,
                         scale: float | None = None) -> torch.Tensor:
        """q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay) and beta [T, Hv]; state pool
        [slots, Hv, Dk, Dv] fp32 -> o [T, Hv, Dv].
        With ``S' = exp(g_t) S_{t-1}``: ``S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T``, ``o_t = S_t^T q_t``
        (q and k L2-normalised when ``use_qk_l2norm``, q scaled by ``scale``, default ``Dk ** -0.5``)."""

    @abstractmethod
    def gated_delta_update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, *,
                           use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
        """One token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> o [B, Hv, Dv]."""

    # -- lightning attention (MiniMax): linear attention with per-head exponential decay -------
    @abstractmethod
    def lightning_scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                       cu_seqlens: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, *,
                       block_size: int | None = None) -> torch.Tensor:
        """q, k [T, H, Dk], v [T, H, Dv], slope [H]; state pool [slots, H, Dk, Dv] fp32 ->
        o [T, H, Dv]. ``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``."""

    @abstractmethod
    def lightning_update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                         state: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
        """One token per sequence: q, k [B, H, Dk], v [B, H, Dv] -> o [B, H, Dv]."""
