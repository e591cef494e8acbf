"""``bench_vs_llamacpp.py``'s logic without llama.cpp: ``--phases`` (runs put in the bandwidth phase
their probes found, the rows per phase, ``read_bandwidth.Probe`` reading a plausible figure) and a
server that ignores SIGTERM stopped all the same."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_vs_llamacpp", BENCH / "bench_vs_llamacpp.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_a_run_is_in_the_phase_both_its_probes_found(bench):
    assert bench.phase_of([60.0, 70.0], 50.0) == "high"
    assert bench.phase_of([37.0, 36.0], 50.0) == "low"
    assert bench.phase_of([60.0, 37.0], 50.0) == "mixed"
    assert bench.phase_of([37.0, 50.0], 50.0) == "mixed"


def test_phase_rows_take_each_engines_runs_in_that_phase(bench):
    args = argparse.Namespace(threads=[1, 2])
    raw = {
        "threshold|2": [50.0],
        "decode|2|llama.cpp": [54.0, 56.0, 52.0, 99.0],
        "probe|2|llama.cpp": [[60.0, 62.0], [38.0, 37.0], [37.0, 36.0], [37.0, 60.0]],
        "decode|2|lmplug": [80.0, 82.0, 55.0],
        "probe|2|lmplug": [[66.0, 70.0], [64.0, 60.0], [36.0, 38.0]],
        "decode|1|lmplug": [50.0],  # no probes at one thread: no phase rows there
    }
    rows = bench.phase_rows(raw, args, weight_bytes_per_token=600e6)
    by = {(r["metric"].split(",")[1].split("(")[0].strip(), r["metric"].split(",")[0]): r for r in rows}
    high, low = by[("high phase", "decode tok/s")], by[("low phase", "decode tok/s")]
    assert (high["llama.cpp"], high["lmplug"]) == (54.0, 81.0)  # the mixed 99.0 is left out
    assert (low["llama.cpp"], low["lmplug"]) == (54.0, 55.0)
    assert "runs 1 / 2" in high["metric"] and "runs 2 / 1" in low["metric"]
    assert all(r["threads"] == 2 for r in rows)
    share = next(r for r in rows if r["metric"] == "% of the probed read bandwidth, high phase")
    assert share["llama.cpp"] == pytest.approx(100 * 54.0 * 0.6 / 61.0)
    assert share["lmplug"] == pytest.approx(100 * 0.6 * (80.0 / 68.0 + 82.0 / 62.0) / 2)


def test_no_phase_rows_without_probes(bench):
    raw = {"decode|2|llama.cpp": [50.0], "decode|2|lmplug": [60.0]}
    assert bench.phase_rows(raw, argparse.Namespace(threads=[2])) == []


def test_the_probe_reads_memory(bench):
    from read_bandwidth import Probe

    gbs = Probe(1, mib=64, passes=1)()
    assert 0.1 < gbs < 10_000


def test_a_server_that_ignores_sigterm_is_killed(bench):
    server = object.__new__(bench.Server)
    code = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "sys.stderr.write('x' * 200000)\nprint('up', flush=True)\ntime.sleep(600)\n")
    with tempfile.TemporaryFile() as log:
        server.name, server.log = "stubborn", log
        server.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log)
        assert server.proc.stdout.readline() == b"up\n"  # its 200 kB of log went to the file, not a full pipe
        peak = server.stop(grace_s=0.5)
        assert server.proc.returncode == -9 and peak > 1
        assert log.closed
    server.proc.stdout.close()
