"""tools/gpu_check.py without a GPU: the wheels it asks for, the plan's pieces, how a step is run,
timed out and summarised (the run on a GPU machine is `make gpu-check`, docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["gpu_check"]
    return module


def test_wheels_leave_out_what_the_gpu_image_has(gpu_check):
    reqs = gpu_check.requirements()
    names = [r.split(">")[0].split("=")[0].lower() for r in reqs]
    assert not [n for n in names if n.startswith(("torch", "triton", "nvidia-"))]
    assert {"pydantic", "pluggy", "gguf", "fastapi", "pytest", "hypothesis", "setuptools"} <= set(names)


def test_every_planned_file_exists_and_every_benchmark_writes_json(gpu_check, tmp_path):
    steps = gpu_check.plan(tmp_path, xdist=False)
    assert {s.kind for s in steps} == {"tests", "conformance", "bench"}
    assert sorted(f for s in steps for f in s.test_files) == sorted(gpu_check.KERNEL_TEST_FILES)
    for step in steps:
        for arg in step.argv[1:]:
            if arg.endswith(".py"):
                assert (ROOT / arg).is_file(), arg
        if step.kind == "bench":
            assert step.argv[-2:] == ["--json", str(step.json_out)]
            assert '"--json"' in (ROOT / step.argv[1]).read_text()
    assert [s.argv[-3:] for s in steps if s.kind == "conformance"] == [
        [b, "--device", "cuda"] for b in gpu_check.CONFORMANCE]
    benches = sum(s.limit_s for s in steps if s.kind == "bench")
    assert gpu_check.CONFORMANCE_LIMIT_S <= gpu_check.TESTS_LIMIT_S  # the two run side by side
    assert gpu_check.SETUP_LIMIT_S + gpu_check.TESTS_LIMIT_S + benches <= 8 * 60


def test_a_step_passes_fails_times_out_and_reports_figures(gpu_check, tmp_path):
    out = tmp_path / "fig.json"
    figures = [{"name": "x share of copy", "value": 0.5, "unit": "fraction", "goal": 0.8, "met": False}]
    write = f"import json; json.dump({{'figures': {figures!r}}}, open({str(out)!r}, 'w')); print('done')"
    good = gpu_check.Step("fig", [sys.executable, "-c", write], 60, "bench", out)
    bad = gpu_check.Step("bad", [sys.executable, "-c", "print('correctness check FAILED: x'); raise SystemExit(1)"],
                         60, "bench")
    slow = gpu_check.Step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1, "bench")
    for step in (good, bad, slow):
        gpu_check.run_step(step, tmp_path, {})
    assert (good.status, good.figures) == ("passed", figures) and "goal is not met" in good.detail
    assert (bad.status, bad.detail) == ("failed", "correctness check FAILED: x")
    assert slow.status == "timed out" and slow.seconds < 20
    gpu_check.write_summary(tmp_path, [good, bad, slow], {"gpu": "none"}, dry_run=False)
    table = (tmp_path / "gpu-check.md").read_text()
    assert "| fig | x share of copy | 50% | >= 80% | NO |" in table
    assert [s["status"] for s in json.loads((tmp_path / "gpu-check.json").read_text())["steps"]] == [
        "passed", "failed", "timed out"]


def test_pytest_counts_are_the_summary(gpu_check):
    text = "....s.F\nFAILED tests/x.py::test_a - AssertionError\n==== 1 failed, 5 passed, 1 skipped in 3.2s ====\n"
    assert gpu_check.summary_line(text) == "1 failed, 5 passed, 1 skipped in 3.2s"
