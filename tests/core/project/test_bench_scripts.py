"""The GPU benchmark scripts run their logic on CPU: ``bench_quant_gpu.py`` without CUDA says why and
exits 0, its ``--interpret-smoke`` mode passes under ``TRITON_INTERPRET=1``, and its correctness
section does fail (exit 1) when a kernel and its reference disagree."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_quant_gpu.py"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def run_script(*args: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_quant_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_quant_gpu_without_cuda_says_why_and_exits_0():
    done = run_script(interpret=False)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout


def test_quant_gpu_interpret_smoke_passes():
    done = run_script("--interpret-smoke", interpret=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "correctness: w4a16_gemm/gemv" in done.stdout
    table = [line.split() for line in done.stdout.splitlines() if line.startswith("fp16 ")]
    kernels = {" ".join(row[4:-5]) for row in table}
    assert kernels == {"dense (cuBLAS)", "gptq4", "gptq4 act-order", "awq4", "gptq8", "fp8 channel",
                       "fp8 block128", "int8 channel"}
    assert len(table) == 2 * len(kernels)  # M = 1 (GEMV) and 20 (GEMM) per kernel


def test_quant_gpu_interpret_smoke_needs_the_interpreter():
    done = run_script("--interpret-smoke", interpret=False)
    assert done.returncode == 2
    assert "TRITON_INTERPRET=1" in done.stdout


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernels on CPU under TRITON_INTERPRET=1")
def test_quant_gpu_correctness_check_catches_a_mismatch(monkeypatch):
    bench = load_bench()
    right = bench.w4a16_dense
    monkeypatch.setattr(bench, "w4a16_dense", lambda case: right(case) * 1.05 if case["awq_order"] else right(case))
    monkeypatch.setattr(bench, "W8A8_KINDS", {})
    failures, _ = bench.check_correctness(torch.float32, "cpu", tokens=(1, 20))
    assert failures and all(f.startswith("awq4") for f in failures)
    assert any("gemv" in f for f in failures) and any("gemm" in f for f in failures)
