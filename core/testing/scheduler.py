"""``SchedulerConformance``: budgets, completion, aborts and preemption, with a fake model.

Workloads run through ``scheduler_harness.Harness`` (an engine loop with a
deterministic fake model) on the suite's accounting-only paged KV cache, so a
failure is the scheduler's own. Every step: at most ``max_num_seqs``
sequences and ``max_num_batched_tokens`` new tokens, storage allocated before
it is scheduled, context read back intact. At the end: every request finished
with the fake model's exact continuation, and KV usage is back to 0.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from lmplug.api import SchedulerLimits
from lmplug.testing.base import Conformance
from lmplug.testing.compare import reported
from lmplug.testing.fakes import FakePagedKV, fake_spec
from lmplug.testing.scheduler_harness import Harness, Request, Workload, random_requests

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "few_short",
            random_requests(0, 4, (3, 8), (2, 6)),
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            num_blocks=64,
        ),
        Workload(
            "many_mixed",
            random_requests(1, 12, (1, 30), (1, 16), n_every=5),
            max_num_seqs=3,
            max_num_batched_tokens=40,
            max_model_len=64,
            num_blocks=40,
        ),
        Workload(
            "hits_max_model_len",
            (Request("long", tuple(range(1, 25)), 100), Request("short", (5, 6), 3)),
            max_num_seqs=2,
            max_num_batched_tokens=32,
            max_model_len=32,
            num_blocks=32,
        ),
        # prompts longer than the token budget: only schedulers that split prompts can run them
        Workload(
            "long_prompts",
            random_requests(2, 3, (40, 60), (2, 4)),
            max_num_seqs=2,
            max_num_batched_tokens=16,
            max_model_len=64,
            num_blocks=48,
            needs=frozenset({"chunked_prefill"}),
        ),
    ]
}

# Admission by prompt size fills the pool; growing then needs blocks that only preemption frees.
TIGHT = Workload(
    "tight_kv",
    random_requests(3, 6, (9, 12), (18, 22)),
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=64,
    num_blocks=20,
    needs=frozenset({"preemption"}),
)


class SchedulerConformance(Conformance):
    family = "scheduler"
    # also run the simple workloads on this registered KV backend (None: only the suite's fake)
    real_kv_backend: ClassVar[str | None] = "contiguous"
    real_kv_options: ClassVar[dict] = {}

    def params_workload(self) -> list:
        return [
            pytest.param(w, id=w.name, marks=self.feature_marks(w.needs))
            for w in WORKLOADS.values()
        ]

    @pytest.fixture
    def harness(self, backend_class, backend_options):
        def make(workload: Workload, kv=None, label: str | None = None) -> Harness:
            kv = kv or FakePagedKV(
                FakePagedKV.Options(),
                fake_spec(workload.max_model_len, workload.max_num_seqs),
                num_blocks=workload.num_blocks,
                block_size=workload.block_size,
            )
            options = backend_class.Options(
                **{
                    **dict(backend_options),
                    "max_num_seqs": workload.max_num_seqs,
                    "max_num_batched_tokens": workload.max_num_batched_tokens,
                }
            )
            limits = SchedulerLimits(
                workload.max_num_seqs, workload.max_num_batched_tokens, workload.max_model_len
            )
            scheduler = backend_class(options, kv, limits)
            return Harness(scheduler, kv, workload, label or self.label())

        return make

    # -- tests -----------------------------------------------------------------------------------
    def test_runs_workload(self, harness, workload: Workload) -> None:
        """Budgets every step; every request finishes with the right tokens; KV usage back to 0."""
        with reported(self.label()):
            h = harness(workload)
            h.add_requests()
            h.run()
            h.check_done()

    def test_abort_frees_resources(self, harness) -> None:
        """Aborting running and waiting requests returns their sequences and frees their KV."""
        workload = WORKLOADS["many_mixed"]
        ids = [r.request_id for r in workload.requests]
        with reported(self.label()):
            h = harness(workload)
            h.add_requests()
            h.run(abort_at={2: [ids[0], ids[-1]], 5: [ids[4], ids[1]]})
            h.check_done()
            if not h.aborted:
                raise h.violation(
                    "no sequence was aborted (all had finished): the workload is too short"
                )

    def test_abort_everything(self, harness) -> None:
        workload = WORKLOADS["many_mixed"]
        with reported(self.label()):
            h = harness(workload)
            h.add_requests()
            for _ in range(3):
                h.step()
            for req in workload.requests:
                h.abort(req.request_id)
            if h.scheduler.has_unfinished() or h.kv.usage != 0:
                raise h.violation(
                    f"after aborting every request: has_unfinished()="
                    f"{h.scheduler.has_unfinished()}, KV usage {h.kv.usage:.3f} (expected 0)"
                )

    def test_preemption_keeps_outputs(self, harness, backend_class) -> None:
        """Under KV pressure, outputs equal those of a run with room to spare."""
        self.require_features(backend_class, "preemption")
        roomy = Workload(
            "tight_kv_with_room",
            TIGHT.requests,
            TIGHT.max_num_seqs,
            TIGHT.max_num_batched_tokens,
            TIGHT.max_model_len,
            num_blocks=200,
        )
        with reported(self.label()):
            runs = []
            for workload in (TIGHT, roomy):
                h = harness(workload)
                h.add_requests()
                h.run()
                h.check_done()
                runs.append(h)
            tight, free = runs
            if tight.num_preempted == 0:
                raise tight.violation(
                    "the KV pool cannot hold every admitted sequence to the end, yet no "
                    "sequence was ever reported in SchedulerOutput.preempted"
                )
            for a, b in zip(tight.seqs, free.seqs):
                if a.output_token_ids != b.output_token_ids:
                    raise tight.violation(
                        f"{a!r} output {a.output_token_ids} under preemption differs "
                        f"from {b.output_token_ids} without it"
                    )

    def test_with_registered_kv_backend(self, harness) -> None:
        """The simple workloads again, on a real KV backend from the registry."""
        if not self.real_kv_backend:
            pytest.skip("real_kv_backend is None: only the suite's fake KV cache is used")
        from lmplug.plugins import get_registry

        try:
            kv_cls = get_registry().get("kvcache", self.real_kv_backend).cls
        except Exception as exc:  # noqa: BLE001 - an unavailable KV backend only skips this check
            pytest.skip(f"kvcache backend {self.real_kv_backend!r} is not available: {exc}")
        for name in ("few_short", "many_mixed"):
            w = WORKLOADS[name]
            label = f"{self.label()} on kvcache backend {self.real_kv_backend!r}"
            with reported(label):
                kv = kv_cls(
                    kv_cls.Options(**self.real_kv_options),
                    fake_spec(w.max_model_len, w.max_num_seqs),
                )
                h = harness(w, kv, label)
                h.add_requests()
                h.run()
                h.check_done()
