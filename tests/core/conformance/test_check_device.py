"""``lmplug plugins --check ... --device cuda`` (and ``python -m lmplug.testing --device``): the
generated suite runs the backend on the device asked for; a missing GPU is one clear error
before pytest starts, not every check skipped."""

from __future__ import annotations

import pytest
import torch

from lmplug.cli import main as cli_main
from lmplug.testing import runner

NO_GPU = "--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is false)"


def test_suite_module_names_the_device():
    source = runner.suite_module("attention", "flash", {"num_splits": 2}, "cuda")
    namespace: dict = {}
    exec(compile(source, "suite", "exec"), namespace)  # noqa: S102 - the generated module itself
    cls = namespace["TestFlash"]
    assert (cls.backend, cls.options, cls.device) == ("flash", {"num_splits": 2}, "cuda")
    assert "device = 'cpu'" in runner.suite_module("attention", "sdpa", {})


def test_device_problems():
    assert runner.device_problem("cpu") is None
    assert "expected one of cpu, cuda" in runner.device_problem("tpu")
    assert runner.device_problem("cuda") == (None if torch.cuda.is_available() else NO_GPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_check_on_cuda_without_a_gpu_is_one_clear_error(capsys):
    assert cli_main(["plugins", "--check", "attention:sdpa", "--device", "cuda"]) == 4
    assert capsys.readouterr().err.strip() == NO_GPU
    assert runner.main(["attention", "sdpa", "--device", "cuda"]) == 4
    assert capsys.readouterr().err.strip() == NO_GPU


def test_device_without_check_is_refused(capsys):
    assert cli_main(["plugins", "--device", "cuda"]) == 2
    assert "--device cuda: only applies to --check" in capsys.readouterr().err
