"""The ``lmplug`` command in-process, and the check every ``lmplug quantize`` test ends with:
``lmplug eval`` of the quantized folder against its float source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def cli(capsys, *args: Any) -> tuple[int, str, str]:
    """``lmplug ARGS`` -> (exit status, stdout, stderr)."""
    from lmplug.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_eval_close(capsys, quantized: Path, reference: Path, tmp_path: Path) -> None:
    """``lmplug eval`` of ``quantized`` against ``reference`` on a held-out text: it runs, its KL
    is small and positive (quantized, but not broken), its perplexity finite."""
    import torch

    text = tmp_path / "held.txt"
    text.write_text("Some held-out text about the data model and statements. " * 4)
    rc, stdout, err = cli(capsys, "eval", quantized, "--text", text, "--reference", reference, "--window", "64")
    assert rc == 0, err
    result = json.loads(stdout)
    assert 0 < result["kl"] < 1 and torch.isfinite(torch.tensor(result["perplexity"]))
