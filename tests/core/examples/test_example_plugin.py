"""``examples/lmplug-example-plugin`` as its users meet it: pip-installed as its own distribution,
found through its entry point, listed by ``lmplug plugins``, passing the conformance suite with
its own five-line test module, chosen from a YAML file and generating what transformers does.

The example is installed with ``pip install --no-deps --no-build-isolation --target`` (offline:
the build uses this venv's setuptools) from a copy, so no build files land in the repository.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import hf_models

from lmplug import LLM, SamplingParams
from lmplug.plugins import ENV_ALLOWLIST, ENV_DISABLE_AUTOLOAD, reset_registry

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lmplug-example-plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(site folder the example is installed into, copy of its source tree with its tests)."""
    root = tmp_path_factory.mktemp("example-plugin")
    source, site = root / "src-copy", root / "site"
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--target",
            str(site),
            str(source),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"pip install of the example failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "lmplug_example" / "chunked.py").exists()
    return site, source


def run_with(
    site: Path, args: list[str], cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    for name in (ENV_ALLOWLIST, ENV_DISABLE_AUTOLOAD):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def test_listed_by_lmplug_plugins(installed):
    site, source = installed
    proc = run_with(
        site, ["-c", "from lmplug.cli import main; raise SystemExit(main(['plugins']))"], source
    )
    assert proc.returncode == 0, proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if " chunked " in ln), None)
    assert line is not None, proc.stdout
    assert line.split()[0] == "attention" and "lmplug-example-plugin 0.1.0" in line
    assert "kv_layouts=contiguous,paged" in line and "features=sliding_window" in line


def test_its_conformance_tests_pass(installed):
    site, source = installed
    proc = run_with(site, ["-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-rA"], source)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    arcee = [line for line in proc.stdout.splitlines() if "TestArceeArchitecture::" in line and line.startswith(("PASSED", "FAILED", "ERROR"))]
    assert len(arcee) >= 3 and all("PASSED" in line for line in arcee), arcee  # the architecture kit ran
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) > 100  # the whole attention suite ran


@pytest.fixture
def on_path(installed, monkeypatch):
    """The installed example visible to this process's entry-point discovery, then forgotten."""
    site, _ = installed
    monkeypatch.delenv(ENV_ALLOWLIST, raising=False)
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    reset_registry()
    yield site
    reset_registry()
    for name in [m for m in sys.modules if m.startswith("lmplug_example")]:
        del sys.modules[name]


def test_selected_from_yaml_and_generates_like_transformers(on_path, tmp_path):
    model = hf_models.get_model("mistral", tmp_path)  # sliding window 16, shorter than the output
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"model: {model.path}\ndevice: cpu\ndtype: float32\nmax_model_len: 64\n"
        "attention:\n  backend: chunked\n  chunk_size: 8\n"
    )
    llm = LLM(config=config)
    att = llm.engine.resolved.backends["attention"]
    assert att.name == "chunked" and att.info.distribution == "lmplug-example-plugin 0.1.0"
    assert att.options.chunk_size == 8
    prompt = hf_models.prompt_ids(10, seed=3)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_models.hf_greedy(model.hf, prompt, 20)


TP_SCRIPT = """
import sys, tempfile
from pathlib import Path
from lmplug import LLM, SamplingParams
from lmplug.testing.architecture import build_tiny, hf_greedy
cfg = {"model_type": "arcee", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "relu2"}
path = Path(tempfile.mkdtemp()) / "arcee"
hf = build_tiny(cfg, path)
ids = [5, 17, 3, 44, 9, 60, 21, 8]
llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, model_impl="arcee",
          parallel={"tensor_parallel_size": 2})
out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
assert out.token_ids == hf_greedy(hf, ids, 16), (out.token_ids, hf_greedy(hf, ids, 16))
print("TP2 OK", type(llm.engine.runner.model).__module__)
"""


def test_its_architecture_serves_under_tensor_parallelism(installed):
    """The workers are other processes: they find ``arcee`` through the same entry point."""
    site, source = installed
    proc = run_with(site, ["-c", TP_SCRIPT], source)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "TP2 OK lmplug_example.arcee" in proc.stdout, proc.stdout[-2000:]
