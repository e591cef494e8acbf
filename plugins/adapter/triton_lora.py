"""The Triton LoRA backend: Punica's segment-grouped shrink and expand (``triton_kernels``).

``prepare`` sorts the step's adapted tokens by slot once per step (host side: the slots are
known there) into segments; every adapted layer then runs two kernels over them. CUDA; on the
CPU only under ``TRITON_INTERPRET=1`` (the tests and the conformance suite).
"""

from __future__ import annotations

import os

import torch

from lmplug.api import AdapterBackend, Capabilities

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton does


class TritonLoRA(AdapterBackend):
    name = "triton"
    capabilities = Capabilities(devices=frozenset({"cuda", "cpu"} if _INTERPRETED else {"cuda"}),
                                priority=1 if _INTERPRETED else 20)  # above torch (10) on CUDA

    def prepare(self, token_slots: torch.Tensor, token_slots_cpu: list[int]) -> object:
        order = sorted((s, t) for t, s in enumerate(token_slots_cpu) if s >= 0)
        starts, lens, slots = [], [], []
        for i, (s, _) in enumerate(order):
            if not slots or slots[-1] != s:
                starts.append(i)
                lens.append(0)
                slots.append(s)
            lens[-1] += 1
        dev = token_slots.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        return (tensor([t for _, t in order]), tensor(starts), tensor(lens), tensor(slots), max(lens, default=0))

    def apply(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: object) -> None:
        from lmplug_adapter.triton_kernels import sgmv

        order, starts, lens, slots, max_len = meta
        if max_len:
            sgmv(y, x, a, b, order, starts, lens, slots, max_len)
