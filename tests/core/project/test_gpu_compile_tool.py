"""``tools/gpu_compile.py`` (``make gpu-compile``) builds a real kernel for sm_80 on a CPU-only
machine and reads its resources, and its limits fail the rows they should.

The compile runs in a subprocess: the tool must load triton in compile mode, while this test
session runs the interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "gpu_compile.py"


@functools.cache
def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_compile", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_compile"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_tool(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMPLUG_CACHE": str(cache)}
    return subprocess.run([sys.executable, str(TOOL), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.slow
def test_one_kernel_config_compiles_for_sm80_with_its_resources(tmp_path):
    out = tmp_path / "table.json"
    args = ("--only", "reshape_and_cache", "--arch", "80", "--sample", "1", "--jobs", "1", "--json", str(out))
    cold = run_tool(tmp_path / "cache", *args)
    assert cold.returncode == 0, cold.stdout + cold.stderr
    header = cold.stdout.splitlines()[1]
    assert "shared B" in header and "regs" in header and "spill B" in header, cold.stdout
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert (row["kernel"], row["arch"], row["status"]) == ("_reshape_and_cache_kernel", 80, "ok")
    assert 0 < row["registers"] <= 255 and row["shared"] >= 0 and row["spill_stores"] == 0
    assert result["summary"]["compiled"] == 1 and result["summary"]["failed"] == 0

    # warm: Triton's cache holds the kernel (no ptxas log), the tool's cache its resources
    warm = run_tool(tmp_path / "cache", *args)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    again = json.loads(out.read_text())["rows"][0]
    assert (again["hash"], again["registers"], again["shared"]) == (row["hash"], row["registers"], row["shared"])


def _row(tool, **fields):
    return {"family": "flash_prefill", "kernel": "_flash_prefill_kernel", "config": "fp16 head_dim=128",
            "arch": 80, "spill_path": "hot", "shared": 1024, "registers": 128, "spill_stores": 0,
            "spill_loads": 0, **fields}


def test_limits_fail_the_rows_that_break_them():
    tool = load_tool()
    assert tool.judge(_row(tool))["status"] == "ok"
    over = tool.judge(_row(tool, shared=tool.SHARED_LIMIT[80] + 1))
    assert over["status"] == "FAILED" and "shared memory" in over["why"]
    assert tool.judge(_row(tool, arch=90, shared=tool.SHARED_LIMIT[80] + 1))["status"] == "ok"
    spilled = tool.judge(_row(tool, spill_stores=4))
    assert spilled["status"] == "FAILED" and "hot budget 0" in spilled["why"]
    budget = tool.SPILL_BUDGET["fp32"]
    assert tool.judge(_row(tool, spill_path="fp32", spill_stores=budget))["status"] == "ok"
    assert tool.judge(_row(tool, spill_path="fp32", spill_stores=budget + 1))["status"] == "FAILED"
    broken = tool.judge(_row(tool, status="FAILED", why="compile error: boom"))
    assert broken["status"] == "FAILED" and broken["why"] == "compile error: boom"


def test_allow_covers_only_its_kernel_arch_and_config():
    tool = load_tool()
    kernel, arch, config, _ = tool.ALLOW[0]
    row = {"family": "w8a8", "kernel": kernel, "arch": arch, "status": "FAILED", "why": "compile error: x"}
    assert tool.judge({**row, "config": f"{config} group_k=0"})["status"] == "allowed"
    assert tool.judge({**row, "config": "int8 group_k=0"})["status"] == "FAILED"
    assert tool.judge({**row, "config": f"{config} group_k=0", "arch": 90})["status"] == "FAILED"


def test_sample_covers_every_axis_value_deterministically():
    tool = load_tool()
    jobs = [tool.Job("m", "k", 80, {}, {}, {}, {}, "flash_prefill", tool.short(p), "hot", p)
            for p in tool.cases("flash_prefill")]
    picked = tool.sample(jobs, 5)
    assert len(picked) == 5 and picked == tool.sample(jobs, 5)
    for axis, values in tool.CASES["flash_prefill"].items():
        assert {job.params[axis] for job in picked} == set(values), axis
    assert len(tool.sample(jobs, 40)) == 40
    assert len({id(job) for job in tool.sample(jobs[:12], 11)}) == 11  # never the same job twice
    assert tool.sample(jobs[:3], 6) == jobs[:3]
