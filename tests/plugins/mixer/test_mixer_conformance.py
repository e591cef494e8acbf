"""The first-party mixer backends through the conformance suite (``lmplug.testing.MixerConformance``).

``triton`` runs its kernels under ``TRITON_INTERPRET=1`` on machines without a GPU (set by
``tests/conftest.py``); there its bf16 cases are skipped, because the interpreter computes
``tl.dot`` on bf16 wrongly. Below, backends with one deliberately wrong op must fail the suite.
"""

from __future__ import annotations

import pytest
import torch
from lmplug_mixer.mixers import TorchMixer
from support.devices import interpreted, kernel_device

from lmplug.api import BackendOptions
from lmplug.testing import MixerConformance
from lmplug.testing.mixer import CASES


class TestTorchMixer(MixerConformance):
    backend = "torch"


# Interpreted, a gated delta rule prefill (three launches of per-chunk programs) takes seconds: its
# second case (raw q/k, custom scale) runs with -m slow there, and always on a GPU.
INTERPRETER_SLOW_CASES = {"gated_delta-raw-qk"}


class TestTritonMixer(MixerConformance):
    backend = "triton"
    device = kernel_device() or "cpu"
    skip_bf16_under_triton_interpreter = True

    def params_case(self) -> list:
        params = super().params_case()
        if not interpreted():
            return params
        return [pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow])
                if p.id in INTERPRETER_SLOW_CASES else p for p in params]


# -- the suite catches wrong backends ------------------------------------------------------------------


class _NoConvState(TorchMixer):
    """Prefill as if every sequence were fresh: ignores (and keeps) the conv state it was given."""

    def conv1d_scan(self, x, weight, bias, cu_seqlens, conv_state, state_indices, activation="silu"):
        zeros = torch.zeros_like(conv_state)
        y = super().conv1d_scan(x, weight, bias, cu_seqlens, zeros, state_indices, activation)
        conv_state[state_indices.long()] = zeros[state_indices.long()]
        return y


class _InterleavedGroups(TorchMixer):
    """SSD with head h reading group h % G instead of h // (H / G)."""

    def ssd_scan(self, x, dt, A, B, C, D, cu_seqlens, state, state_indices, **kw):
        group = torch.arange(x.shape[1]) % B.shape[1]  # B[:, group] has one "group" per head
        return super().ssd_scan(x, dt, A, B[:, group], C[:, group], D, cu_seqlens, state, state_indices, **kw)


class _NoDecayDecode(TorchMixer):
    """Lightning decode that forgets the decay: S <- S + k^T v."""

    def lightning_update(self, q, k, v, slope, state, state_indices):
        return super().lightning_update(q, k, v, torch.zeros_like(slope), state, state_indices)


class _WritesEveryRow(TorchMixer):
    """Gated delta rule decode that also zeroes the rows no sequence of the call holds."""

    def gated_delta_update(self, q, k, v, g, beta, state, state_indices, **kw):
        out = super().gated_delta_update(q, k, v, g, beta, state, state_indices, **kw)
        keep = torch.zeros(state.shape[0], dtype=torch.bool)
        keep[state_indices.long()] = True
        state[~keep] = 0
        return out


class _Check(MixerConformance):
    """Not collected (no Test prefix): its checks are called directly on the broken backends."""


BROKEN = [
    pytest.param(_NoConvState, "test_scan_matches_reference", "conv1d",
                 "output differs from the float64 recurrence", id="conv-ignores-state"),
    pytest.param(_InterleavedGroups, "test_scan_matches_reference", "ssd",
                 "output differs from the float64 recurrence", id="ssd-interleaved-groups"),
    pytest.param(_NoDecayDecode, "test_update_steps", "lightning",
                 "output differs from the float64 recurrence", id="lightning-no-decay"),
    pytest.param(_WritesEveryRow, "test_update_steps", "gated_delta",
                 "but no sequence of the call holds them", id="delta-writes-other-rows"),
]


@pytest.mark.parametrize(("backend_cls", "check", "case_name", "message"), BROKEN)
def test_suite_fails_a_wrong_backend(backend_cls, check, case_name, message) -> None:
    case = next(c for c in CASES if c.name == case_name)
    with pytest.raises(pytest.fail.Exception, match=message):
        getattr(_Check(), check)(backend_cls, BackendOptions(), case, "float32")
    getattr(_Check(), check)(TorchMixer, BackendOptions(), case, "float32")  # the correct twin passes
