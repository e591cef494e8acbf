"""The architecture conformance kit on first-party architectures beyond Llama (which
tests/plugins/transformers/test_kit_on_llama.py covers): the MoE decoders, on the parity tests'
tiny configs, tensor parallelism included."""

from __future__ import annotations

from typing import ClassVar

import pytest
from support.hf_models import _BASE
from support.moe_models import MOE_SPECS

from lmplug.testing.architecture import ArchitectureConformance

pytestmark = pytest.mark.hf


class TestKitOnMoE(ArchitectureConformance):
    backend = "moe"
    configs: ClassVar[dict] = {name: {**_BASE, **MOE_SPECS[name]} for name in ("mixtral", "qwen2_moe")}
