"""Fixtures of the attention tests."""

import pytest


@pytest.fixture(scope="module")
def native():
    """``lmplug_attention.paged.native`` (the C decode kernel), skipping where it cannot be built."""
    from lmplug_attention.paged import native as paged_native

    ok, why = paged_native.available()
    if not ok:
        pytest.skip(f"the native kernel does not build here: {why}")
    return paged_native
