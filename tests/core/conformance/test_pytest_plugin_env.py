"""The pytest plugin changes nothing in a project that does not use the conformance suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run_pytest(tmp_path, body: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_foreign.py").write_text(textwrap.dedent(body))
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LMPLUG_TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={**clean, **env}, capture_output=True, text=True, timeout=300,
                          check=False)


def test_a_foreign_project_keeps_its_environment(tmp_path):
    out = _run_pytest(tmp_path, """
        import os
        def test_env():
            assert "TRITON_INTERPRET" not in os.environ
        """)
    assert out.returncode == 0, out.stdout + out.stderr


def test_asking_for_a_conformance_class_sets_the_interpreter_without_a_gpu(tmp_path):
    out = _run_pytest(tmp_path, """
        import os
        import torch
        from lmplug.testing import SchedulerConformance  # noqa: F401
        def test_env():
            assert os.environ.get("TRITON_INTERPRET") == ("1" if not torch.cuda.is_available() else None)
        """)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_start_time_choice_is_honoured(tmp_path):
    out = _run_pytest(tmp_path, """
        import os
        def test_env():
            assert os.environ.get("TRITON_INTERPRET") == "1"
        """, LMPLUG_TRITON_INTERPRET="1")
    assert out.returncode == 0, out.stdout + out.stderr
