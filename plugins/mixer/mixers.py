"""Mixer backends (``mixer: torch | triton``): the state-layer ops over the engine's state pools.

- ``torch``: the PyTorch references (``conv1d_ref``, ``ssd_ref``, ``delta_ref``, ``lightning_ref``),
  the CPU default and the ground truth;
- ``triton``: the Triton kernels beside them (``*_kernels``): chunked-parallel prefill scans and
  fused single-step updates (on a CPU only under ``TRITON_INTERPRET=1``, for tests).

Both read and write each sequence's pool row (``state_indices``) in place. The gated delta rule's
functions take dense ``[B, ...]`` states, so its rows are gathered here and written back.
"""

from __future__ import annotations

import math
import os

from lmplug.api import Capabilities, MixerBackend

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class TorchMixer(MixerBackend):
    name = "torch"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), priority=10)

    def __init__(self, options) -> None:
        super().__init__(options)
        from lmplug_mixer import conv1d_ref, delta_ref, lightning_ref, ssd_ref

        self._conv, self._ssd, self._delta, self._lightning = conv1d_ref, ssd_ref, delta_ref, lightning_ref

    def conv1d_scan(self, x, weight, bias, cu_seqlens, conv_state, state_indices, activation="silu"):
        return self._conv.causal_conv1d(x, weight, bias, cu_seqlens, conv_state, activation,
                                        state_indices=state_indices)[0]

    def conv1d_update(self, x, weight, bias, conv_state, state_indices, activation="silu"):
        return self._conv.causal_conv1d_update(x, conv_state, weight, bias, activation,
                                               state_indices=state_indices)

    def ssd_scan(self, x, dt, A, B, C, D, cu_seqlens, state, state_indices, *, chunk_size, dt_bias=None,
                 dt_softplus=True, dt_limit=(0.0, math.inf)):
        return self._ssd.ssd_chunk_scan(x, dt, A, B, C, D, cu_seqlens, state, chunk_size, dt_bias=dt_bias,
                                        dt_softplus=dt_softplus, dt_limit=dt_limit,
                                        state_indices=state_indices)[0]

    def ssd_update(self, x, dt, A, B, C, D, state, state_indices, *, dt_bias=None, dt_softplus=True,
                   dt_limit=(0.0, math.inf)):
        return self._ssd.ssd_state_update(state, x, dt, A, B, C, D, dt_bias, dt_softplus=dt_softplus,
                                          dt_limit=dt_limit, state_indices=state_indices)

    def gated_delta_scan(self, q, k, v, g, beta, cu_seqlens, state, state_indices, *, chunk_size=64,
                         use_qk_l2norm=True, scale=None):
        rows = state_indices.long()
        out, final = self._delta.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state[rows], chunk_size,
                                                        use_qk_l2norm, scale)
        state[rows] = final
        return out

    def gated_delta_update(self, q, k, v, g, beta, state, state_indices, *, use_qk_l2norm=True, scale=None):
        rows = state_indices.long()
        dense = state[rows]
        out = self._delta.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, dense, use_qk_l2norm, scale)
        state[rows] = dense
        return out

    def lightning_scan(self, q, k, v, slope, cu_seqlens, state, state_indices, *, block_size=None):
        kw = {} if block_size is None else {"block_size": block_size}
        return self._lightning.lightning_attention_prefill(q, k, v, slope, cu_seqlens, state,
                                                           state_indices=state_indices, **kw)[0]

    def lightning_update(self, q, k, v, slope, state, state_indices):
        return self._lightning.lightning_attention_decode(q, k, v, slope, state, state_indices=state_indices)


class TritonMixer(TorchMixer):
    """The Triton kernels; the gated delta rule's state rows gathered and written back as above."""

    name = "triton"
    capabilities = Capabilities(devices=frozenset({"cuda"}),
                                named_devices=frozenset({"cpu"} if _INTERPRETED else ()),  # tests: named only
                                priority=30)

    def __init__(self, options) -> None:
        MixerBackend.__init__(self, options)
        from lmplug_mixer import conv1d_kernels, delta_kernels, lightning_kernels, ssd_kernels

        self._conv, self._ssd, self._delta, self._lightning = (conv1d_kernels, ssd_kernels, delta_kernels,
                                                               lightning_kernels)
