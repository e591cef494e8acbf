"""`lmplug plugins --check model:NAME [--hf-config PATH]` runs the architecture kit."""

from __future__ import annotations

import json

import pytest

from lmplug.cli import main

pytestmark = pytest.mark.hf


def test_check_runs_the_kit_on_an_authors_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma2", "vocab_size": 256, "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
                                "attn_logit_softcapping": 50.0}))
    assert main(["plugins", "--check", "model:transformers", "--hf-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model backend 'transformers'" in out and "test_preemption_in_a_tiny_pool" in out


def test_check_names_an_unreadable_config(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert main(["plugins", "--check", "model:transformers", "--hf-config", str(missing)]) == 4
    assert f"--hf-config {missing}: cannot read" in capsys.readouterr().err
