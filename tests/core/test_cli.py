"""The command line, run as a user runs it: a subprocess of the installed `lmplug` script."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

LMPLUG = [sys.executable, "-m", "lmplug.cli"]


def run(*args, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LMPLUG, *args], input=stdin, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, check=False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("command", ["generate", "chat", "plugins", "models", "bench"])
def test_help(command):
    proc = run(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: lmplug" in proc.stdout


def test_plugins_lists_first_party_backends():
    proc = run("plugins")
    assert proc.returncode == 0, proc.stderr
    for family, name in [("attention", "sdpa"), ("kvcache", "contiguous"), ("scheduler", "static")]:
        line = next(line for line in proc.stdout.splitlines() if line.split()[:2] == [family, name])
        assert "lmplug 0.2.0" in line and "devices=" in line


def test_bad_config_is_one_clear_line(tmp_path, tiny_model):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"model: {tiny_model}\nscheduler: {{backend: static, max_num_seqs: 0}}\n")
    proc = run("generate", "--config", str(cfg), "hello")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert str(cfg) in proc.stderr and "scheduler.max_num_seqs" in proc.stderr


def test_unknown_backend_lists_available(tiny_model):
    proc = run("generate", "--model", str(tiny_model), "--attention", "nope", "hi")
    assert proc.returncode == 2
    assert "unknown attention backend 'nope'" in proc.stderr and "sdpa" in proc.stderr


def test_missing_model_is_clear():
    proc = run("generate", "--model", "/nonexistent/model", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "/nonexistent/model" in proc.stderr


def test_text_prompt_without_tokenizer_is_refused(tiny_model):
    # The tiny model has no tokenizer, so text prompts are refused with a clear message.
    proc = run("generate", "--model", str(tiny_model), "--max-tokens", "4", "hello")
    assert proc.returncode == 2 and "tokenizer" in proc.stderr


def test_models_list_with_empty_cache(tmp_path):
    proc = run("models", "list", env={"LMPLUG_CACHE": str(tmp_path)})
    assert proc.returncode == 0 and "lmplug models pull" in proc.stdout


def test_generate_demo_model_with_stats(demo_gguf):
    proc = run("generate", "--model", str(demo_gguf), "--chat", "--temperature", "0", "--max-tokens", "12",
               "--stats", "What is the capital of France? Answer in one sentence.")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "TTFT" in proc.stderr and "tokens/s" in proc.stderr


def test_chat_reads_turns_from_stdin(demo_gguf):
    proc = run("chat", "--model", str(demo_gguf), "--temperature", "0", "--max-tokens", "12",
               stdin="What is the capital of France? Answer in one sentence.\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "assistant>" in proc.stdout and "Paris" in proc.stdout


def test_plugins_check_runs_the_conformance_suite():
    proc = run("plugins", "--check", "scheduler:static")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lmplug conformance: scheduler backend 'static'" in proc.stdout
    ambiguous = run("plugins", "--check", "paged")
    assert ambiguous.returncode == 2 and "attention:paged, kvcache:paged" in ambiguous.stderr
