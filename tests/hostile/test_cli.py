"""Hostile and careless input to the `lmplug` command: each failure is one line on stderr and
exit status 2, never a traceback or a hang (run as a user runs it: a subprocess)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

LMPLUG = [sys.executable, "-m", "lmplug.cli"]
NO_MODEL = "no-such-model-anywhere"


def run(*args, stdin: str | None = None, module: list[str] = LMPLUG) -> subprocess.CompletedProcess:
    return subprocess.run([*module, *map(str, args)], input=stdin, check=False, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    first = err.splitlines()[-1] if err else ""
    assert err.startswith("lmplug: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return first


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


# -- config files that are not config files --------------------------------------------------------

@pytest.mark.parametrize("kind", ["/dev/zero", "/dev/urandom", "fifo", "big", "bad-yaml", "binary"])
def test_config_file_refused_before_reading(tmp_path, kind):
    path = Path(kind) if kind.startswith("/dev/") else tmp_path / f"{kind}.yaml"
    if kind == "fifo":
        os.mkfifo(path)  # reading it would block forever: nobody writes
    elif kind == "big":
        path.write_text("# padding\n" * 120_000)  # > 1 MiB of valid YAML
    elif kind == "bad-yaml":
        path.write_text("model: m\nattention: {\n")
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00model")
    proc = run("generate", "-c", path, "--max-tokens", "1", "hi")
    needle = {"big": "larger than", "bad-yaml": "not valid YAML", "binary": "not UTF-8"}.get(kind, "not a regular file")
    one_line_error(proc, str(path), needle)


# -- flags and --set ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,needles", [
    (["--set", "attention={"], ["--set attention={", "not valid YAML", "'attention'"]),
    (["--device", "cuda"], ["--device cuda", "device: 'cuda'"]),
    (["--set", "seed=99999999999999999999999"], ["--set seed=", "seed", "18446744073709551615"]),
    (["--set", "seed=-1"], ["--set seed=-1", "seed"]),
    (["--set", "kvcache.backend=paged", "--set", "kvcache.block_size=10"], ["--set kvcache.block_size=10"]),
    (["--set", "bogus=1"], ["--set bogus=1", "unknown option"]),
])
def test_bad_flags_are_one_line_errors(flags, needles):
    if flags[:2] == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    proc = run("generate", "--model", NO_MODEL, "--max-tokens", "1", *flags, "hi")
    one_line_error(proc, *needles)
    assert "default config:" not in proc.stderr and "default.yaml" not in proc.stderr
    assert proc.stderr.count("(got ") <= 1 and "got 10 (got 10)" not in proc.stderr


def test_version():
    from importlib.metadata import version

    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"lmplug {version('lmplug')}"


# -- serve: --model like the other commands, and the port checked before the model loads -------------

def test_serve_takes_model_as_flag_or_positional():
    from lmplug.cli import _overrides, _parser
    from lmplug.errors import LmplugError

    for argv in (["serve", "--model", "m1"], ["serve", "-m", "m1"], ["serve", "m1"], ["serve", "m1", "--model", "m1"]):
        assert _overrides(_parser().parse_args(argv))["model"] == "m1", argv
    with pytest.raises(LmplugError, match="--model 'm2' and the positional MODEL 'm1' differ"):
        _overrides(_parser().parse_args(["serve", "m1", "--model", "m2"]))


def test_serve_checks_its_port_before_loading_the_model():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run("serve", "--model", NO_MODEL, "--port", port)
    one_line_error(proc, f"--port {port}")
    assert NO_MODEL not in proc.stderr  # it never got as far as looking for the model


# -- chat and progress output into pipes ----------------------------------------------------------------

def test_chat_prints_no_prompts_into_a_pipe(tiny_model):
    proc = run("chat", "--model", tiny_model, "--temperature", "0", "--max-tokens", "2",
               stdin="\n\n/exit\n")  # two turns read (empty ones are skipped), no model call
    assert proc.returncode == 0, proc.stderr
    assert "you>" not in proc.stdout and "you>" not in proc.stderr


def test_quantize_picks_a_group_size_that_fits_and_draws_no_bars(tmp_path):
    """SmolLM2-135M's widths (hidden 576 = 9 x 64, intermediate 1536): 128 does not divide 576."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=64)
    model = tmp_path / "smol-shaped"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model)
    proc = run("quantize", model, tmp_path / "out", "--method", "rtn")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["group_size"] == 64 and summary["bits"] == 4
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 64 and qc["bits"] == 4
    assert "\r" not in proc.stderr  # stderr is a pipe: no progress-bar redraws


def test_group_size_that_fits_nothing_says_what_to_pass():
    from types import SimpleNamespace

    from lmplug_quant.quantizers.rtn import RTNQuantizer

    from lmplug.errors import ConfigError

    q = RTNQuantizer(RTNQuantizer.Options())
    cfg = SimpleNamespace(hidden_size=100, intermediate_size=300, num_heads=4, head_dim=25)
    with pytest.raises(ConfigError, match=r"none of 128, 64, 32 divides.*--group-size -1"):
        q.check_model(SimpleNamespace(cfg=cfg))


def test_progress_without_a_terminal_writes_whole_lines(capsys):
    from lmplug.quantize import make_progress

    progress = make_progress()
    for i in range(1, 4):
        progress("stage", i, 3)
    err = capsys.readouterr().err
    assert "\r" not in err and err == "stage: 3/3\n"


# -- the conformance runner -------------------------------------------------------------------------------

def test_conformance_runner_bad_option_is_one_clean_error():
    proc = run("kvcache", "paged", "-o", "blok_size=8", module=[sys.executable, "-m", "lmplug.testing"])
    assert proc.returncode == 4, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "-o blok_size: unknown option" in lines[0] and "block_size" in lines[0]
    assert "validation error" not in proc.stdout + proc.stderr and "passed" not in proc.stdout


# -- logprobs carry their token's text --------------------------------------------------------------------

def test_logprobs_are_decoded_where_a_tokenizer_exists():
    import torch

    from lmplug.interfaces.params import SamplingParams
    from lmplug.interfaces.sequence import Sequence
    from lmplug.outputs.logprobs import record_prompt_logprobs, token_logprobs

    class Tok:
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            Tok.calls += 1
            return "".join(f"<t{i}>" for i in ids)

    tok = Tok()
    seq = Sequence("r", [1, 2, 3], SamplingParams(logprobs=2, prompt_logprobs=1, max_tokens=4))
    logits = torch.randn(3, 8)
    rows = token_logprobs(logits, [seq], [[5]], [[2]], tokenizer=tok)
    assert rows[0][0] and all(lp.decoded_token == f"<t{t}>" for t, lp in rows[0][0].items())
    record_prompt_logprobs(seq, 0, logits, tokenizer=tok)
    assert all(lp.decoded_token == f"<t{t}>" for row in seq.prompt_logprobs[1:] for t, lp in row.items())
    plain = token_logprobs(logits, [seq], [[5]], [[2]])  # no tokenizer: no text
    assert all(lp.decoded_token is None for lp in plain[0][0].values())
    no_ask = Sequence("q", [1], SamplingParams(max_tokens=4))
    before = Tok.calls
    assert token_logprobs(logits, [no_ask], [[5]], [[2]], tokenizer=tok) == [None] and Tok.calls == before
