"""``lmplug bench serve`` against a real server on loopback (a tiny random llama): its percentiles
recomputed from the per-request timings it records, goodput, the workloads, the PNG, bad flags."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import subprocess
import sys
import time
import zlib

import httpx
import numpy as np
import pytest
from support.hf_models import get_model
from support.serve_util import running_server

from lmplug import LLM
from lmplug.cli import main
from lmplug.serve import ServeSettings


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = get_model("llama", tmp_path_factory.mktemp("bench_serve"), tokenizer=True)
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=128)
    with running_server(llm, ServeSettings(api_key="", served_model_name="tiny")) as running:
        yield running


def bench(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "run.json"
    code = main(["bench", "serve", "--base-url", server.v1, "--num-prompts", "6", "--input-len", "8",
                 "--output-len", "5", "--token-range", "3,500", "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def reference(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1000
    return {f"p{p}_ms": float(np.percentile(arr, p)) for p in (50, 90, 99)}


def test_percentiles_follow_the_recorded_timings(server, tmp_path):
    runs = bench(server, tmp_path, "--concurrency", "1,3", "--slo", "ttft=60000,tpot=60000")["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    for run in runs:
        recs, s = run["records"], run["summary"]
        assert s["completed"] == len(recs) == 6 and s["errors"] == 0
        assert all(r["output_tokens"] == 5 and len(r["token_times"]) >= 1 for r in recs)  # ignore_eos: max_tokens
        ttft = [r["token_times"][0] - r["start"] for r in recs]
        tpot = [(r["end"] - r["token_times"][0]) / (r["output_tokens"] - 1) for r in recs]
        itl = [b - a for r in recs for a, b in zip(r["token_times"], r["token_times"][1:])]
        e2e = [r["end"] - r["start"] for r in recs]
        for key, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
            for name, want in reference(values).items():
                assert s[key][name] == pytest.approx(want, rel=1e-9), (key, name)
        assert all(0 < a <= b for a, b in zip(ttft, e2e))
        assert s["output_throughput"] == pytest.approx(30 / s["wall_s"])
        assert s["goodput"] == pytest.approx(6 / s["wall_s"])  # bounds every request meets


def test_goodput_counts_only_requests_within_the_slo(server, tmp_path):
    run = bench(server, tmp_path, "--concurrency", "2", "--slo", "ttft=0.001")["runs"][0]
    assert run["summary"]["goodput"] == 0.0  # no request answers within a microsecond


def test_rate_sweep_over_a_shared_prefix(server, tmp_path):
    runs = bench(server, tmp_path, "--dataset", "prefix", "--prefix-len", "16", "--request-rate", "4,inf",
                 "--concurrency", "4")["runs"]
    assert [r["rate"] for r in runs] == [4.0, math.inf] and all(r["summary"]["errors"] == 0 for r in runs)
    assert all(r["prompt_tokens"] == 24 for run in runs for r in run["records"])  # 16 shared + 8 own
    paced, burst = ([r["start"] for r in run["records"]] for run in runs)
    assert max(paced) > 0.1  # Poisson gaps at 4/s: five of them are ~1.25 s (P(< 0.1 s) ~ 1e-5)
    assert sorted(burst)[3] < 0.1  # all at once: the first four (the cap) start together


def test_two_servers_plot_is_a_png(server, tmp_path):
    pytest.importorskip("matplotlib")  # a dev dependency; without it --plot is refused by name (below)
    png = tmp_path / "sweep.png"
    runs = bench(server, tmp_path, "--base-url", server.v1, "--label", "a", "--label", "b",
                 "--concurrency", "1,2", "--plot", str(png))["runs"]
    assert [(r["server"], r["concurrency"]) for r in runs] == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert_valid_png(png)


def assert_valid_png(path) -> None:
    """The PNG spec's structure (signature, IHDR first, every chunk's CRC-32, IEND last), and an
    independent decoder (matplotlib's, through Pillow) reads an image of the header's size."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body, (crc,) = data[at + 8:at + 8 + length], struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        at += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"") and at == len(data)
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width > 400 and height > 200
    import matplotlib.image

    assert matplotlib.image.imread(str(path)).shape[:2] == (height, width)


def test_sharegpt_json(server, tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hello world"},
                                                   {"from": "gpt", "value": "hi"}]},
                                {"conversations": [{"from": "human", "value": "a b c"}]}]))
    run = bench(server, tmp_path, "--dataset", "sharegpt", "--dataset-path", str(path))["runs"][0]
    counts = {httpx.post(server.url + "/tokenize", json={"prompt": t}, timeout=30).json()["count"]
              for t in ("hello world", "a b c")}
    assert run["summary"]["completed"] == 6 and {r["prompt_tokens"] for r in run["records"]} == counts


def test_plot_without_matplotlib_is_refused_by_name(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["bench", "serve", "--base-url", server.v1, "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("flags", "says"), [
    (["--slo", "ttft"], "--slo: 'ttft' is not KEY=MS"),
    (["--concurrency", "0"], "--concurrency values must be >= 1"),
    (["--dataset", "sharegpt"], "needs --dataset-path"),
    (["--token-range", "9"], "--token-range"),
])
def test_bad_flags_are_named(server, tmp_path, capsys, flags, says):
    assert main(["bench", "serve", "--base-url", server.v1, *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.slow
def test_the_commands_end_to_end(tmp_path):
    """``lmplug serve`` and ``lmplug bench serve`` as the commands a user runs, on loopback: the
    percentiles in --json follow its recorded timings, and --plot writes a valid PNG."""
    pytest.importorskip("matplotlib")
    tiny = get_model("llama", tmp_path / "m", tokenizer=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env.pop("LMPLUG_API_KEY", None)
    serve = subprocess.Popen([sys.executable, "-m", "lmplug.cli", "serve", str(tiny.path), "--port", str(port),
                              "--device", "cpu", "--max-model-len", "128", "--served-model-name", "tiny"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not ready(url):
            assert serve.poll() is None and time.monotonic() < deadline, "lmplug serve did not come up"
            time.sleep(0.3)
        out, png = tmp_path / "run.json", tmp_path / "run.png"
        bench_cmd = subprocess.run([sys.executable, "-m", "lmplug.cli", "bench", "serve", "--base-url", url + "/v1",
                                    "--num-prompts", "5", "--input-len", "6", "--output-len", "4", "--token-range",
                                    "3,500", "--concurrency", "1,2", "--json", str(out), "--plot", str(png)],
                                   env=env, capture_output=True, text=True, timeout=300, check=False)
        assert bench_cmd.returncode == 0, bench_cmd.stderr
    finally:
        serve.terminate()
        serve.wait(30)
    for run in json.loads(out.read_text())["runs"]:
        recs, summary = run["records"], run["summary"]
        assert len(recs) == summary["completed"] == 5
        e2e = [r["end"] - r["start"] for r in recs]
        ttft = [r["token_times"][0] - r["start"] for r in recs]
        for key, values in (("e2e", e2e), ("ttft", ttft)):
            for name, want in reference(values).items():
                assert summary[key][name] == pytest.approx(want, rel=1e-9), (key, name)
    assert "TTFT" in bench_cmd.stdout  # the printed table
    assert_valid_png(png)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
