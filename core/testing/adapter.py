"""``AdapterConformance``: what every LoRA backend (``adapter`` family) must hold to.

- ``apply`` adds ``b[s] @ (a[s] @ x[t])`` into ``y[t]`` for each token's slot s, checked against
  the math in float64 here, for steps of one token, a decode batch, and prefill-sized steps, rows of
  one slot in runs and interleaved, several slots, ranks padded with zeros, fused (K > 1) layers;
- tokens without an adapter (slot -1) come back bit-identical, and a step whose every token
  has none leaves ``y`` as it was;
- ``prepare`` is read by many layers: applying twice with one ``meta`` adds twice;
- options out of range are refused naming the field (``max_loras``, ``max_lora_rank``).
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from pydantic import ValidationError

from lmplug.interfaces.adapter import AdapterBackend
from lmplug.testing.base import Conformance
from lmplug.testing.compare import DEFAULT_TOLERANCES, DTYPES, find_mismatch

# (tokens, slots, shards, rank, in, out): a decode token, a decode batch, prefill-sized steps
CASES = [(1, 1, 1, 4, 32, 48), (7, 3, 3, 8, 64, 96), (16, 4, 2, 16, 48, 40), (12, 9, 3, 8, 48, 40),
         (45, 3, 1, 8, 64, 64),
         (130, 5, 2, 16, 96, 80)]


def reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              slots: list[int]) -> torch.Tensor:
    """The math, one token at a time, in float64."""
    out = y.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += b[s].double() @ (a[s].double() @ x[t].double())
    return out


class AdapterConformance(Conformance):
    family = "adapter"
    cases: ClassVar[list[tuple[int, int, int, int, int, int]]] = CASES

    @pytest.fixture(scope="class")
    @classmethod
    def lora(cls, backend_class, backend_options) -> AdapterBackend:
        return backend_class(backend_options)

    def params_case(self) -> list:
        return [pytest.param(c, id="T{}-S{}-K{}-r{}".format(*c[:4])) for c in self.cases]

    def inputs(self, case, dtype: str, pattern: str, seed: int = 0):
        tokens, num_slots, shards, rank, d_in, d_out = case
        g = torch.Generator().manual_seed(seed)
        dt = DTYPES[dtype]
        x = torch.randn(tokens, d_in, generator=g).to(dt).to(self.device)
        y = torch.randn(tokens, d_out, generator=g).to(dt).to(self.device)
        a = (torch.randn(num_slots, shards * rank, d_in, generator=g) / d_in ** 0.5)
        b = torch.randn(num_slots, d_out, shards * rank, generator=g) / rank ** 0.5
        a[:, rank // 2:rank] = 0  # slot ranks below the maximum: zero padding
        a, b = a.to(dt).to(self.device), b.to(dt).to(self.device)
        if pattern == "runs":  # rows of a slot side by side, some without an adapter
            slots = [min((t * num_slots) // tokens, num_slots - 1) if t % 5 != 3 else -1 for t in range(tokens)]
        else:  # interleaved, as a scheduler's order leaves them
            slots = [int(s) - 1 for s in torch.randint(0, num_slots + 1, (tokens,), generator=g)]
        return y, x, a, b, slots

    def run(self, lora: AdapterBackend, y, x, a, b, slots, times: int = 1) -> torch.Tensor:
        out = y.clone()
        meta = lora.prepare(torch.tensor(slots, dtype=torch.int32, device=self.device), list(slots))
        for _ in range(times):
            lora.apply(out, x, a, b, meta)
        return out

    @pytest.mark.parametrize("pattern", ["runs", "interleaved"])
    def test_apply_matches_the_math(self, lora, case, dtype, pattern):
        y, x, a, b, slots = self.inputs(case, dtype, pattern)
        out = self.run(lora, y, x, a, b, slots)
        want = reference(y.cpu(), x.cpu(), a.cpu(), b.cpu(), slots)
        atol, rtol = DEFAULT_TOLERANCES[dtype]
        bad = find_mismatch(out.cpu().double(), want, atol * 4, rtol * 4)
        assert bad is None, f"{self.label()} {case} {pattern}: " + bad.summary(atol * 4, rtol * 4)

    def test_rows_without_adapter_unchanged(self, lora, case, dtype):
        y, x, a, b, slots = self.inputs(case, dtype, "interleaved", seed=1)
        out = self.run(lora, y, x, a, b, slots)
        none = [t for t, s in enumerate(slots) if s < 0]
        assert torch.equal(out[none], y[none]), f"{self.label()}: rows with slot -1 changed"
        out = self.run(lora, y, x, a, b, [-1] * len(slots))
        assert torch.equal(out, y), f"{self.label()}: a step with no adapter changed y"

    def test_meta_reused_by_every_layer(self, lora, case):
        y, x, a, b, slots = self.inputs(case, "float32", "runs", seed=2)
        once = self.run(lora, y, x, a, b, slots)
        twice = self.run(lora, y, x, a, b, slots, times=2)
        torch.testing.assert_close(twice - y, 2 * (once - y), atol=1e-4, rtol=1e-4)

    def test_options_out_of_range_refused(self, backend_class):
        for field, value in (("max_loras", 0), ("max_lora_rank", 0), ("max_cpu_loras", 0)):
            with pytest.raises(ValidationError, match=field):
                backend_class.Options(**{field: value})
