"""Fixtures of the native GGUF kernels' tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kernel():
    """The loaded native GGUF library; the test is skipped, with the reason, where it does not build."""
    gguf_native = pytest.importorskip("lmplug_quant.gguf_native")
    ok, why = gguf_native.available()
    if not ok:
        pytest.skip(f"the native kernels do not build here: {why}")
    return gguf_native.load()
