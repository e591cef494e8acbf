"""The GPU checks, in one run: what a lent GPU machine runs from a copy of the working tree.

    python tools/gpu_check.py                  # on a CUDA machine: set-up, tests, conformance, benchmarks
    python tools/gpu_check.py --dry-run        # anywhere: the plan, and a check that each piece exists
    python tools/gpu_check.py --download-wheels --python-version 3.12     # (make gpu-wheels), here

Why one script: a lent GPU is a few minutes of device time on a machine that cannot reach a
package registry. Its image has torch and triton but not all of lmplug's pure-Python
dependencies, so ``make gpu-wheels`` downloads them here into ``.gpu-wheels/`` (ignored by git;
carry it with the tree), and the set-up step installs them from there with
``pip install --no-index --find-links .gpu-wheels`` and lmplug itself with
``pip install --no-deps --no-build-isolation -e .`` when ``import lmplug`` fails.

Then, with ``TRITON_INTERPRET=0`` (kernels compiled):

1. correctness, concurrently: the Triton kernel tests (pytest; tests/conftest.py's
   ``kernel_device`` fixture puts them on ``cuda``) and the conformance suite of the ``flash``
   and ``paged`` attention backends on ``cuda`` (``lmplug plugins --check ... --device cuda``);
2. the GPU benchmarks, one at a time (each checks its kernels against their references before
   timing and writes ``--json``): flash prefill vs SDPA's best backend, paged decode GB/s vs copy
   bandwidth, fused MoE vs the per-expert loop, W4A16 GEMV / W8A8 GEMM vs cuBLAS, MLA decode GB/s.

Every step has its own time limit; a failing or timed-out step is recorded and the rest still
run. The summary - a markdown table and a JSON file, with each benchmark's headline figures and
goals - and every step's log go to ``$OUT`` if set, else ``./gpu-check-out/``. The exit status
is 1 if any step failed. ``--dry-run`` needs no GPU: it prints the plan and checks that every
file exists, every benchmark accepts its arguments (``--help``), the CLI knows ``--device`` and
the kernel tests collect under the interpreter.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"
# what the GPU image provides itself (and must not be replaced by a wheel)
NOT_DOWNLOADED = ("torch", "triton", "nvidia-")
# the dev tools the kernel tests need, besides the runtime dependencies (transformers is in the
# image: it is large, and the tests that use it import whatever version is there)
TEST_REQUIREMENTS = ("pytest", "hypothesis")
BUILD_REQUIREMENTS = ("setuptools>=68", "wheel")  # pip install -e . --no-build-isolation
KERNEL_TEST_FILES = [
    "tests/plugins/attention/test_flash_kernels.py",
    "tests/plugins/attention/test_mla_kernels.py",
    "tests/plugins/attention/test_paged_kernels.py",
    "tests/plugins/kvcache/test_kv_quant.py",
    "tests/plugins/moe/test_moe_kernels.py",
    "tests/plugins/moe/test_moe_quant.py",
    "tests/plugins/quant/test_w4a16_kernels.py",
    "tests/plugins/quant/test_quant_w8a8.py",
]
BENCHMARKS = {  # name -> (script, arguments sized to fit the time budget, time limit in s)
    "bench flash prefill/decode": ("benchmarks/bench_flash_gpu.py", [
        "--lens", "4096", "8192", "16384", "--head-dims", "128", "--dtypes", "bf16", "--decode-batches", "16",
        "--quick"], 65),
    "bench paged decode": ("benchmarks/bench_paged_decode.py", ["--dtype", "bfloat16"], 40),
    "bench fused MoE": ("benchmarks/bench_moe.py", ["--skip-cpu", "--gpu-tokens", "1", "64", "1024", "4096"], 45),
    "bench W4A16/W8A8": ("benchmarks/bench_quant_gpu.py", [
        "--dtypes", "bf16", "--tokens", "1", "16", "1024", "--quick"], 60),
    "bench MLA decode": ("benchmarks/bench_mla_decode.py", ["--quick"], 40),
}
CONFORMANCE = ["attention:flash", "attention:paged"]
TESTS_LIMIT_S = 150
CONFORMANCE_LIMIT_S = 150  # runs alongside the tests
SETUP_LIMIT_S = 60  # both pip installs; with the correctness phase (150 s) and the benchmarks
# (250 s) the whole run stays under 8 minutes
LMPLUG_CLI = [sys.executable, "-c", "import sys; from lmplug.cli import main; sys.exit(main())"]


@dataclass
class Step:
    name: str
    argv: list[str]
    limit_s: int
    kind: str  # "tests", "conformance" (run concurrently), "bench" (one at a time), "setup"
    json_out: Path | None = None
    test_files: list[str] = field(default_factory=list)
    # filled in by running it
    status: str = "not run"
    seconds: float = 0.0
    detail: str = ""
    figures: list[dict] = field(default_factory=list)

    def record(self) -> dict:
        return {"name": self.name, "command": shlex.join(self.argv), "limit_s": self.limit_s,
                "status": self.status, "seconds": round(self.seconds, 1), "detail": self.detail,
                "figures": self.figures}


# -- dependencies ----------------------------------------------------------------------------------

def requirements() -> list[str]:
    """lmplug's dependencies the GPU image may lack: pyproject's, less torch/triton/nvidia-*, plus
    what the kernel tests and an editable install need."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0]: r for r in project["optional-dependencies"]["dev"]}
    wanted = list(project["dependencies"]) + [dev.get(name, name) for name in TEST_REQUIREMENTS]
    kept = [r for r in wanted if not r.lower().startswith(NOT_DOWNLOADED)]
    return kept + list(BUILD_REQUIREMENTS)


def download_wheels(python_version: str, dest: Path) -> int:
    """``pip download`` the requirements (and what they need) as wheels for linux x86_64."""
    digits = python_version.replace(".", "")
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)] + ["manylinux2014_x86_64"]
    argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python_version,
            "--implementation", "cp", "--abi", f"cp{digits}", "--abi", "abi3", "--abi", "none",
            *[a for p in platforms for a in ("--platform", p)], "--platform", "any", "-d", str(dest),
            *requirements()]
    print("$ " + shlex.join(argv), flush=True)
    return subprocess.call(argv)


def missing_modules(python: str) -> list[str]:
    """Modules of lmplug and the test tools that ``python`` cannot import."""
    probe = ("import importlib.util as u, json; print(json.dumps([m for m in "
             "['lmplug', 'pydantic', 'pluggy', 'safetensors', 'yaml', 'tokenizers', 'jinja2', 'gguf', "
             "'fastapi', 'uvicorn', 'prometheus_client', 'importlib_metadata', 'pytest', 'hypothesis'] "
             "if u.find_spec(m) is None]))")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def setup(log: Path) -> tuple[str, str]:
    """Install what is missing; returns (status, detail)."""
    missing = missing_modules(sys.executable)
    if not missing:
        return "passed", "lmplug and its dependencies import already"
    commands = []
    if [m for m in missing if m != "lmplug"]:
        if not WHEELS.is_dir():
            return "failed", (f"missing {', '.join(missing)} and no .gpu-wheels/ folder: run `make gpu-wheels` "
                              "where pip reaches a registry, and carry .gpu-wheels with the tree")
        commands.append([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(WHEELS),
                         *requirements()])
    commands.append([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                     str(ROOT)])
    deadline = time.monotonic() + SETUP_LIMIT_S
    with log.open("w") as f:
        for argv in commands:
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            try:
                done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                                      timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return "timed out", f"`{shlex.join(argv[:6])} ...` ran past {SETUP_LIMIT_S} s (see the log)"
            if done.returncode:
                return "failed", f"`{shlex.join(argv[:6])} ...` exited {done.returncode} (see the log)"
    still = missing_modules(sys.executable)
    if still:
        return "failed", f"still missing after the install: {', '.join(still)}"
    return "passed", f"installed {', '.join(missing)}"


# -- the plan --------------------------------------------------------------------------------------

def plan(out: Path, xdist: bool) -> list[Step]:
    py = sys.executable
    workers = ["-n", "4"] if xdist else []
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *workers]
    flash, others = KERNEL_TEST_FILES[0], KERNEL_TEST_FILES[1:]
    steps = [
        # the flash tests run on one module-level device; the others take `kernel_device`, whose
        # id ("cuda") selects exactly the cases that run on the GPU
        Step("tests: flash kernels", [*pytest, flash], TESTS_LIMIT_S, "tests", test_files=[flash]),
        Step("tests: paged, MLA, KV quant, MoE, W4A16, W8A8 kernels", [*pytest, "-k", "cuda", *others],
             TESTS_LIMIT_S, "tests", test_files=others),
    ]
    for backend in CONFORMANCE:
        steps.append(Step(f"conformance {backend} --device cuda", [*LMPLUG_CLI, "plugins", "--check", backend,
                                                                    "--device", "cuda"],
                          CONFORMANCE_LIMIT_S, "conformance"))
    for name, (script, args, limit) in BENCHMARKS.items():
        json_out = out / f"{Path(script).stem}.json"
        steps.append(Step(name, [py, script, *args, "--json", str(json_out)], limit, "bench", json_out))
    return steps


# -- running ---------------------------------------------------------------------------------------

def run_step(step: Step, logs: Path, env: dict) -> None:
    log = logs / (re.sub(r"[^A-Za-z0-9]+", "-", step.name).strip("-") + ".log")
    started = time.monotonic()
    with log.open("w") as f:
        f.write(f"$ {shlex.join(step.argv)}\n")
        f.flush()
        proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's whole process group, nothing else
            proc.wait()
            code = None
    step.seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    if code is None:
        step.status, step.detail = "timed out", f"stopped after {step.limit_s} s"
    else:
        step.status = "passed" if code == 0 else "failed"
        step.detail = summary_line(text) or f"exit status {code}"
    if step.json_out is not None and step.json_out.is_file():
        try:
            step.figures = json.loads(step.json_out.read_text()).get("figures", [])
        except json.JSONDecodeError as exc:
            step.detail += f"; unreadable --json output: {exc}"
    for f in step.figures:
        if f.get("met") is False and step.status == "passed":
            step.detail += "; a goal is not met"
            break


def summary_line(text: str) -> str:
    """pytest's closing counts, a FAILED line, or the last non-empty line of the output."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"\d+ (passed|failed|errors?|skipped|deselected|tests? collected)", ln) and " in " in ln:
            return ln.strip("= ")
    failed = [ln for ln in lines if ln.startswith(("FAILED", "correctness check FAILED", "ERROR"))]
    return failed[0][:300] if failed else (lines[-1][:300] if lines else "")


def environment() -> dict:
    info = {"python": sys.version.split()[0]}
    for module in ("torch", "triton"):
        try:
            info[module] = importlib.import_module(module).__version__
        except ImportError:
            info[module] = None
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    except ImportError:
        pass
    return info


def write_summary(out: Path, steps: list[Step], env_info: dict, dry_run: bool) -> None:
    lines = [f"# lmplug GPU check{' (dry run)' if dry_run else ''}", "",
             "environment: " + ", ".join(f"{k} {v}" for k, v in env_info.items()), "",
             "| step | status | seconds | detail |", "| --- | --- | ---: | --- |"]
    for s in steps:
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.detail.replace('|', '/')} |")
    figures = [(s.name, f) for s in steps for f in s.figures]
    if figures:
        lines += ["", "| benchmark | figure | value | goal | met |", "| --- | --- | ---: | ---: | --- |"]
        for name, f in figures:
            value = f"{f['value']:.0%}" if f.get("unit") == "fraction" else f"{f['value']:.3g} {f.get('unit', '')}"
            goal = f.get("goal")
            goal_text = "" if goal is None else (f">= {goal:.0%}" if f.get("unit") == "fraction" else f">= {goal:g}")
            met = {True: "yes", False: "NO", None: ""}[f.get("met")]
            lines.append(f"| {name} | {f['name']} | {value} | {goal_text} | {met} |")
    (out / "gpu-check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu-check.json").write_text(json.dumps(
        {"dry_run": dry_run, "environment": env_info, "steps": [s.record() for s in steps]}, indent=1))
    print("\n".join(lines))


# -- dry run ----------------------------------------------------------------------------------------

def dry_run_checks(steps: list[Step]) -> None:
    """Every file exists, every benchmark takes its arguments, the CLI knows --device, the tests collect."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    for step in steps:
        started = time.monotonic()
        files = [a for a in step.argv if a.endswith(".py")]
        absent = [f for f in files if not (ROOT / f).is_file()]
        if absent:
            step.status, step.detail = "failed", f"missing {', '.join(absent)}"
        elif step.kind == "bench":
            script = files[0]
            done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=ROOT, check=False,
                                  env=env, timeout=120)
            flags = [a for a in step.argv[2:] if a.startswith("--")]
            unknown = [f for f in flags if f not in done.stdout]
            ok = done.returncode == 0 and not unknown
            step.status = "ok" if ok else "failed"
            step.detail = "--help lists " + " ".join(flags) if ok else (
                f"--help exited {done.returncode}; flags not listed: {' '.join(unknown)}")
        elif step.kind == "conformance":
            done = subprocess.run([*LMPLUG_CLI, "plugins", "--help"], capture_output=True, text=True, cwd=ROOT, check=False,
                                  env=env, timeout=120)
            ok = done.returncode == 0 and "--device" in done.stdout
            step.status, step.detail = ("ok", "`lmplug plugins --help` lists --device") if ok else (
                "failed", "`lmplug plugins` has no --device option")
        else:  # the same files and selection; under the interpreter the device ids say cpu
            select = ["-k", "cpu"] if "-k" in step.argv else []
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *select,
                    *step.test_files]
            done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
            step.status = "ok" if done.returncode == 0 else "failed"
            step.detail = "collects under the interpreter: " + summary_line(done.stdout)
        step.seconds = time.monotonic() - started
        print(f"  {step.status:7} {step.name}: {step.detail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and check its pieces; no GPU needed")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT, else ./gpu-check-out)")
    p.add_argument("--download-wheels", action="store_true",
                   help="pip download the dependencies the GPU image lacks into .gpu-wheels/ and exit")
    p.add_argument("--python-version", default="3.12", help="with --download-wheels: the GPU image's Python")
    args = p.parse_args(argv)
    if args.download_wheels:
        return download_wheels(args.python_version, WHEELS)

    out = (args.out or Path(os.environ.get("OUT") or ROOT / "gpu-check-out")).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    xdist = importlib.util.find_spec("xdist") is not None
    steps = plan(out, xdist)
    print("plan (each step: time limit; correctness steps run concurrently, then the benchmarks in turn):")
    print(f"  {'setup':<55} {SETUP_LIMIT_S:>4}s  install from .gpu-wheels/ if lmplug does not import")
    for s in steps:
        print(f"  {s.name:<55} {s.limit_s:>4}s  {shlex.join(s.argv[1:] if s.argv[0] == sys.executable else s.argv)}")
    env_info = environment()
    if args.dry_run:
        dry_run_checks(steps)
        write_summary(out, steps, env_info, dry_run=True)
        return 1 if any(s.status == "failed" for s in steps) else 0

    setup_step = Step("setup", [], SETUP_LIMIT_S, "setup")
    started = time.monotonic()
    setup_step.status, setup_step.detail = setup(logs / "setup.log")
    setup_step.seconds = time.monotonic() - started
    steps.insert(0, setup_step)
    if setup_step.status == "passed":
        import torch

        if not torch.cuda.is_available():
            setup_step.status, setup_step.detail = "failed", "no CUDA GPU is visible (torch.cuda.is_available())"
    if setup_step.status != "passed":
        write_summary(out, steps, env_info, dry_run=False)
        return 1
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1"}
    correctness = [s for s in steps if s.kind in ("tests", "conformance")]
    with ThreadPoolExecutor(max_workers=len(correctness)) as pool:
        list(pool.map(lambda s: run_step(s, logs, env), correctness))
    for s in correctness:
        print(f"  {s.status:9} {s.seconds:5.0f}s  {s.name}: {s.detail}", flush=True)
    for s in (s for s in steps if s.kind == "bench"):
        run_step(s, logs, env)
        print(f"  {s.status:9} {s.seconds:5.0f}s  {s.name}: {s.detail}", flush=True)
    write_summary(out, steps, env_info, dry_run=False)
    return 1 if any(s.status != "passed" for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
