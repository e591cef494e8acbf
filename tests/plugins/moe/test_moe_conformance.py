"""The first-party moe backends through the conformance suite (``lmplug.testing.MoEConformance``).

``fused`` runs its Triton kernels under ``TRITON_INTERPRET=1`` on machines
without a GPU (set by ``tests/conftest.py``); there its bf16 cases are
skipped, because the interpreter computes ``tl.dot`` on bf16 wrongly.
"""

from __future__ import annotations

from lmplug.testing import MoEConformance


class TestReferenceMoE(MoEConformance):
    backend = "reference"


class TestFusedMoE(MoEConformance):
    backend = "fused"
    skip_bf16_under_triton_interpreter = True
