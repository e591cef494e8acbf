"""The rule that the core never imports a plugin package (plugins are found through entry points)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from lmplug.plugins import ENV_ALLOWLIST, ENV_DISABLE_AUTOLOAD

ROOT = Path(__file__).resolve().parents[3]


# -- the core never imports a plugin package -------------------------------------------------------


def _plugin_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"{path}:{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0].startswith("lmplug_")
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0].startswith("lmplug_"):
                found.append(f"{path}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value.startswith("lmplug_")
                ):
                    found.append(f"{path}:{node.lineno}: {fname}({arg.value!r})")
    return found


def test_core_sources_never_import_plugins():
    files = sorted((ROOT / "core").rglob("*.py"))
    assert len(files) > 10
    offenders = [hit for f in files for hit in _plugin_imports(f)]
    assert offenders == []


def test_plugin_import_scanner_catches_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os, lmplug_attention.sdpa\nfrom lmplug_kvcache import x\n"
        "import importlib\nimportlib.import_module('lmplug_moe')\nfrom lmplug import y\n"
    )
    assert len(_plugin_imports(bad)) == 3


def test_importing_the_core_loads_no_plugin():
    code = textwrap.dedent("""
        import importlib, importlib.util, json, pkgutil, sys
        import lmplug
        import lmplug.engine.engine
        if importlib.util.find_spec("lmplug.cli") is not None:
            import lmplug.cli
        skipped = []
        for mod in pkgutil.walk_packages(lmplug.__path__, "lmplug."):
            try:
                importlib.import_module(mod.name)
            except Exception as exc:  # modules being written elsewhere; the ast test covers them
                skipped.append(f"{mod.name}: {exc!r}")
        reg = lmplug.plugins.get_registry()
        print(json.dumps({"plugins": sorted(m for m in sys.modules if m.startswith("lmplug_")),
                          "registered": sorted(dict(reg.pm.list_name_plugin())),
                          "skipped": skipped}))
    """)
    env = {**os.environ, ENV_DISABLE_AUTOLOAD: "1"}
    env.pop(ENV_ALLOWLIST, None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["plugins"] == [], result
    assert result["registered"] == []
