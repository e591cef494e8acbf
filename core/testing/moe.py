"""``MoEConformance``: routing and expert computation against float64 references.

``route`` is compared with ``reference_route`` (softmax over experts, top-k,
optional renormalisation, as Mixtral and Qwen-MoE route); a backend with
another rule (sigmoid, grouped top-k) overrides ``reference_route`` with the
published formula. Chosen experts must be the same set per token, with the
same weight per expert. ``experts`` is compared with dense per-token,
per-expert SwiGLU MLPs, including skewed routings (every token to one
expert, experts that get no token).
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from lmplug.testing import reference as ref
from lmplug.testing.base import Conformance
from lmplug.testing.compare import DTYPES, fail, find_mismatch, reported, tolerance_for

# (tokens, experts, top_k, hidden, intermediate)
ROUTING_CASES = [(1, 8, 2, 32, 64), (7, 8, 2, 32, 64), (33, 16, 4, 64, 32), (16, 8, 1, 32, 64)]


class MoEConformance(Conformance):
    family = "moe"
    cases: ClassVar[list[tuple[int, int, int, int, int]]] = ROUTING_CASES
    route_tolerance: ClassVar[float] = 1e-5
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {
        "float32": (1e-4, 1e-4),
        "float16": (5e-3, 5e-3),
        "bfloat16": (3e-2, 3e-2),
    }

    def reference_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.reference_route(router_logits, top_k, renormalize)

    def params_case(self) -> list:
        return [pytest.param(c, id=f"T{c[0]}-E{c[1]}-k{c[2]}") for c in self.cases]

    def params_renormalize(self) -> list:
        return [pytest.param(True, id="renormalize"), pytest.param(False, id="raw")]

    def params_routing(self) -> list:
        return [pytest.param(r, id=r) for r in ("random", "one_expert", "unused_experts")]

    # -- tests -------------------------------------------------------------------------------------
    def test_route_matches_reference(
        self, backend_class, backend_options, case, renormalize
    ) -> None:
        tokens, experts, top_k = case[:3]
        logits = torch.randn(
            tokens, experts, generator=torch.Generator().manual_seed(tokens * experts)
        )
        where = f"{self.label()}, route(T={tokens}, E={experts}, top_k={top_k}, renormalize={renormalize})"
        with reported(self.label()):
            ids, weights = backend_class(backend_options).route(
                logits.to(self.device), top_k, renormalize
            )
        ref_ids, ref_weights = self.reference_route(logits, top_k, renormalize)
        if tuple(ids.shape) != (tokens, top_k) or tuple(weights.shape) != (tokens, top_k):
            fail(
                f"{where}: returned ids {tuple(ids.shape)} and weights {tuple(weights.shape)}; "
                f"expected ({tokens}, {top_k}) each"
            )
        ids, weights = _by_expert(ids.cpu().long(), weights.cpu().double())
        ref_ids, ref_weights = _by_expert(ref_ids, ref_weights)
        wrong = (ids != ref_ids).any(dim=1)
        if wrong.any():
            t = int(wrong.nonzero()[0])
            fail(
                f"{where}: token {t} routed to experts {ids[t].tolist()}, the reference chose "
                f"{ref_ids[t].tolist()} ({int(wrong.sum())} of {tokens} tokens differ)"
            )
        bad = find_mismatch(weights, ref_weights, self.route_tolerance, self.route_tolerance)
        if bad is not None:
            fail(
                f"{where}: routing weights differ from the reference: "
                f"{bad.summary(self.route_tolerance, self.route_tolerance)} (index = [token, expert "
                f"in ascending id order]); with renormalize=True the k weights of a token sum to 1"
            )

    def test_experts_match_dense_reference(
        self, backend_class, backend_options, case, dtype, routing
    ) -> None:
        tokens, experts, top_k, hidden, inter = case
        gen = torch.Generator().manual_seed(tokens + experts)
        dt = DTYPES[dtype]
        x = torch.randn(tokens, hidden, generator=gen).to(dt)
        w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dt)
        w_down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dt)
        ids, weights = _routing(routing, tokens, experts, top_k, gen)
        where = (
            f"{self.label()}, experts(T={tokens}, E={experts}, top_k={top_k}, hidden={hidden}, "
            f"intermediate={inter}, dtype {dtype}, routing {routing})"
        )
        with reported(self.label()):
            args = [t.to(self.device) for t in (x, ids, weights.to(dt), w_gate_up, w_down)]
            out = backend_class(backend_options).experts(*args)
        if tuple(out.shape) != (tokens, hidden) or out.dtype != dt:
            fail(
                f"{where}: returned {tuple(out.shape)} {out.dtype}; expected ({tokens}, {hidden}) {dt}"
            )
        expected = ref.reference_experts(x, ids, weights.to(dt), w_gate_up, w_down)
        atol, rtol = tolerance_for(self.tolerances, dtype)
        bad = find_mismatch(out.cpu(), expected, atol, rtol)
        if bad is not None:
            t = bad.index[0]
            fail(
                f"{where}: output differs from the dense per-expert reference: {bad.summary(atol, rtol)}; "
                f"token {t} was routed to experts {ids[t].tolist()} with weights "
                f"{[round(w, 4) for w in weights[t].tolist()]} (w_gate_up rows: gate first, then up)"
            )


def _by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's (expert, weight) pairs by expert id: the order of the k slots is free."""
    order = ids.argsort(dim=1)
    return ids.gather(1, order), weights.gather(1, order)


def _routing(
    kind: str, tokens: int, experts: int, top_k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "one_expert":  # every token's first choice is expert 0: one expert gets everything
        ids = torch.stack(
            [
                torch.cat(
                    [
                        torch.zeros(1, dtype=torch.long),
                        1 + torch.randperm(experts - 1, generator=gen)[: top_k - 1],
                    ]
                )
                for _ in range(tokens)
            ]
        )
    elif kind == "unused_experts":  # only the first top_k + 1 experts are ever chosen
        ids = torch.stack([torch.randperm(top_k + 1, generator=gen)[:top_k] for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return ids, weights
