"""docs/configuration.md is generated from the config models; keep it current."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_configuration_doc_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_config.py"), "--check"], check=False)
    assert proc.returncode == 0, "docs/configuration.md is stale: run `.venv/bin/python docs/gen_config.py`"
