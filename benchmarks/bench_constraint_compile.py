"""A plain request's latency beside heavy constraint compiles, and the memory those compiles leave.

    OMP_NUM_THREADS=1 python benchmarks/bench_constraint_compile.py     # xgrammar, then llguidance
    python benchmarks/bench_constraint_compile.py --backends xgrammar --repeats 5

Starts ``lmplug serve`` on the demo model (in its own process; one torch thread as above) per constraint backend,
with the limits raised so that issue 45's heavy constraints really compile: 4,096 long
``guided_choice`` options, a 110,000-string enum, a 490-deep array schema. For each it sends the
heavy request, then ``--repeats`` plain 8-token completions one after another while the heavy one
is still compiling (each is marked ``!`` if the heavy one had already finished when it ended), and
reports the plain latency beside it against the same requests alone (median). Compiles run in a
worker process and the engine thread never waits for them, so the ratio stays near 1 (the machine's
other load apart: quote ``/proc/loadavg``). Last, four different 100,000-value enums and the
server's RSS before and after them (the compiled-constraint cache is bounded in bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from bench_serve import start_server

PLAIN = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
HEAVY = {
    "choice-4096-long": {"guided_choice": [f"option number {i} " + "x" * 200 for i in range(4096)]},
    "enum-110k": {"guided_json": {"enum": [str(i) for i in range(110_000)]}},
    "array-490-deep": {"guided_json": json.loads('{"type": "array", "items": ' * 490 + '{"type": "integer"}'
                                                 + "}" * 490)},
}
LIMITS = ["structured_output.max_enum_values=200000", "structured_output.max_schema_depth=1000",
          "structured_output.max_compile_s=600"]


def post(url: str, body: dict, key: str) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    resp = httpx.post(url + "/completions", content=json.dumps(body, separators=(",", ":")).encode(),
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                      timeout=1200)
    return time.perf_counter() - started, resp


def plain_latencies(url: str, key: str, repeats: int, busy: threading.Thread | None = None) -> list[str]:
    out = []
    for _ in range(repeats):
        elapsed, resp = post(url, PLAIN, key)
        assert resp.status_code == 200, resp.text
        out.append((elapsed, busy is not None and not busy.is_alive()))
    return out


def rss_mb(pid: int) -> float:
    """The process's resident memory, its compile workers' apart."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_backend(backend: str, model: str, repeats: int, key: str, parts: list[str]) -> None:
    args = ["--max-model-len", "512", "--max-body-bytes", str(4 << 20),
            "--set", f"structured_output.backend={backend}"]
    for limit in LIMITS:
        args += ["--set", limit]
    proc, url = start_server(model, args, key)
    try:
        post(url, PLAIN, key)
        post(url, {**PLAIN, "guided_choice": ["yes", "no"]}, key)  # the compile worker is up
        if "latency" in parts:
            latencies(url, key, repeats, backend)
        if "memory" in parts:
            memory(url, key, proc.pid, backend)
    finally:
        proc.terminate()
        proc.wait(60)


def latencies(url: str, key: str, repeats: int, backend: str) -> None:
    alone = [t for t, _ in plain_latencies(url, key, repeats)]
    base = statistics.median(alone)
    print(f"\n[{backend}] plain 8-token completion alone: median {base:.3f} s "
          f"({', '.join(f'{t:.3f}' for t in alone)})")
    for name, extra in HEAVY.items():
        result: dict = {}
        heavy = threading.Thread(target=lambda r, body: r.update(zip(("s", "resp"), post(url, body, key))),
                                 args=(result, {**PLAIN, **extra}))
        heavy.start()
        time.sleep(0.5)  # the heavy request has reached the compile pool
        beside = plain_latencies(url, key, repeats, heavy)
        heavy.join()
        med = statistics.median(t for t, _ in beside)
        status = result["resp"].status_code
        detail = "" if status == 200 else f" ({result['resp'].json()['error']['message'][:90]})"
        print(f"[{backend}] beside {name}: median {med:.3f} s = {med / base:.2f}x alone "
              f"({', '.join(f'{t:.3f}' + ('!' if late else '') for t, late in beside)}); "
              f"the heavy request: {status} after {result['s']:.1f} s{detail}")


def memory(url: str, key: str, pid: int, backend: str) -> None:
    before = rss_mb(pid)
    for k in range(4):
        enum = {"enum": [f"{k}-{i}" for i in range(100_000)]}
        elapsed, resp = post(url, {**PLAIN, "guided_json": enum}, key)
        print(f"[{backend}] 100k enum #{k + 1}: {resp.status_code} in {elapsed:.1f} s, server RSS "
              f"{rss_mb(pid):.0f} MB")
    workers = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    print(f"[{backend}] RSS before the four enums {before:.0f} MB, after {rss_mb(pid):.0f} MB "
          f"(compile workers: {', '.join(f'{rss_mb(w):.0f} MB' for w in workers)})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", nargs="+", default=["latency", "memory"], choices=["latency", "memory"])
    a = p.parse_args()
    print("loadavg:", Path("/proc/loadavg").read_text().strip(), file=sys.stderr)
    for backend in a.backends:
        run_backend(backend, a.model, a.repeats, "bench", a.parts)
    print("loadavg:", Path("/proc/loadavg").read_text().strip(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
