"""The transformers fallback against transformers itself, one tiny config per family (the kit's
checks: logprobs within 1e-4 and 32 greedy tokens under contiguous and paged KV, batched with
chunked prefill equal to alone, preemption)."""

from __future__ import annotations

import pytest
from support.fallback_configs import FAMILIES, config

from lmplug.testing.architecture import ArchitectureConformance

pytestmark = pytest.mark.hf


def _suite(family: str) -> type:
    return type(f"TestFallback_{family}", (ArchitectureConformance,),
                {"backend": "transformers", "configs": {family: config(family)}})


for _family in FAMILIES:
    globals()[f"TestFallback_{_family}"] = _suite(_family)
