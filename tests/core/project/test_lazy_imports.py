"""Fast start: the ``lmplug`` command imports only what the command it runs needs.

Each check runs a fresh interpreter (``sys.modules`` of the test process is full of everything)
and reads back the modules it imported. ``import lmplug.cli`` and building the parser (what
``lmplug --help`` and ``lmplug models list`` do) must not import torch; a CPU ``generate`` must
not import Triton, HF transformers, the server stack, jinja2 (no chat template), or backends its
config does not choose (offline quantizers, drafters, MoE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

NEVER_ON_CPU_GENERATE = ("triton", "transformers", "fastapi", "uvicorn", "starlette", "httpx",
                         "lmplug.serve", "lmplug.bench", "lmplug.evaluate", "lmplug.quantize",
                         "lmplug.testing", "lmplug.train_host")
NOT_CHOSEN = ("lmplug_quant.quantizers", "lmplug_speculative.", "lmplug_moe.")


def _modules_after(code: str, tmp_path: Path) -> set[str]:
    """Run ``code`` in a fresh interpreter; the modules it had imported when it ended."""
    out = tmp_path / "modules.json"
    script = f"{code}\nimport json, sys\njson.dump(sorted(sys.modules), open({str(out)!r}, 'w'))\n"
    # a user's shell: no Triton interpreter switch (make test sets one), one thread, a private cache
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON")}
    env.update(OMP_NUM_THREADS="1", LMPLUG_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(out.read_text()))


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """The modules of ``names`` that were imported (``x.`` matches x's submodules, ``x`` also x)."""
    return sorted(m for m in modules for n in names
                  if m.startswith(n) if n.endswith(".") or m == n or m.startswith(n + "."))


def test_cli_and_its_parser_import_no_torch(tmp_path):
    modules = _modules_after("import lmplug.cli\nlmplug.cli._parser()", tmp_path)
    heavy = ("torch", "pydantic", "jinja2", "numpy", *NEVER_ON_CPU_GENERATE)
    assert _loaded(modules, heavy) == []
    assert "lmplug.cli" in modules


def test_cpu_generate_imports_only_what_it_runs(tmp_path):
    from support.gguf_fixtures import write_tiny_gguf

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    argv = ["generate", "--model", str(model), "--device", "cpu", "--max-tokens", "2",
            "--temperature", "0", "hello"]
    modules = _modules_after(
        "import sys\nimport lmplug\nassert 'torch' not in sys.modules, 'import lmplug imported torch'\n"
        # the package's names still resolve, on first use
        "from lmplug import LLM, API_VERSION, EngineConfig, SamplingParams\n"
        "assert LLM.__module__ == 'lmplug.llm' and API_VERSION == 3\n"
        f"from lmplug.cli import main\nassert main({argv!r}) == 0", tmp_path)
    assert "lmplug.engine.engine" in modules  # it did generate
    assert _loaded(modules, NEVER_ON_CPU_GENERATE) == []
    assert _loaded(modules, ("jinja2",)) == []  # no --chat: no chat template compiled
    assert _loaded(modules, NOT_CHOSEN) == []
