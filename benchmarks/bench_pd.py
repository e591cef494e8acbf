"""Prefill/decode disaggregation under a mixed load: long prompts arriving among streaming decodes.

    python benchmarks/bench_pd.py [--model smollm2-135m-instruct] [--long-tokens 1024] [--num-long 3]
        [--num-streams 3] [--stream-tokens 48] [--threads 2]

Three deployments, each a real ``lmplug serve`` process driven over HTTP:
  pd          ``--role pd``: a prefill and a decode instance (``--threads`` split between them) and
              the router; every request is prefilled on one side, decoded on the other;
  chunked     one engine (``--threads``), chunked prefill on (long prompts share steps with decodes);
  unchunked   one engine (``--threads``), chunked prefill off (a long prompt holds a whole step).

Workload: ``--num-streams`` streaming requests (short prompts, ``--stream-tokens`` tokens each) start
together; once they are streaming, ``--num-long`` requests with ``--long-tokens``-token prompts
(distinct random token ids, ``max_tokens`` 8) arrive ``--gap`` seconds apart. Reported per
deployment: p50 / p99 of the streams' time between tokens (TPOT, every gap of every stream: a long
prefill shows up as a stall), the long requests' mean TTFT, the prompt bytes the prefill instance
moved per long request and the send time per block (the connector's ``/metrics`` counters, pd only).
Prints ``uptime``'s load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time

import httpx

Row = tuple[str, float, float, float, float, float]  # deployment, p50, p99, max TPOT, TTFT, stream TTFT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, deployment: str, port: int) -> subprocess.Popen:
    threads = max(1, args.threads // 2) if deployment == "pd" else args.threads
    max_len = args.long_tokens + 256
    # unchunked: a prompt longer than the step budget would never be admitted
    budget = max_len if deployment == "unchunked" else args.batch_tokens
    flags = ["--max-model-len", str(max_len), "--port", str(port),
             "--set", f"scheduler.chunked_prefill={'false' if deployment == 'unchunked' else 'true'}",
             "--set", f"scheduler.max_num_batched_tokens={budget}"]
    if deployment == "pd":
        flags += ["--role", "pd"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    env.pop("LMPLUG_API_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "lmplug.cli", "serve", args.model, *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not healthy after {limit_s} s")


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the text chunks of one streamed completion (the first: its TTFT)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times = [time.perf_counter()]
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


async def warm_up(args, url: str) -> None:
    """One long prompt and one short stream: the first steps' one-off costs stay out of the figures."""
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(stream(client, url, token_ids(rng, args.long_tokens), 2),
                             stream(client, url, token_ids(rng, 32), 4))


async def workload(args, url: str, rng: random.Random) -> tuple[list[list[float]], list[list[float]]]:
    def ids(n: int) -> list[int]:
        return token_ids(rng, n)

    async with httpx.AsyncClient(timeout=600) as client:
        streams = [asyncio.create_task(stream(client, url, ids(32), args.stream_tokens))
                   for _ in range(args.num_streams)]
        await asyncio.sleep(args.warmup)
        longs = []
        for _ in range(args.num_long):
            longs.append(asyncio.create_task(stream(client, url, ids(args.long_tokens), 8)))
            await asyncio.sleep(args.gap)
        return await asyncio.gather(*streams), await asyncio.gather(*longs)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def connector_counters(ports: dict[str, int]) -> dict[str, float]:
    """The ``lmplug_kvconnector_*`` gauges of the instances on ``ports``, summed."""
    out = {}
    for port in ports.values():
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for name, value in re.findall(r"^lmplug_kvconnector_(\w+) (\S+)$", text, re.MULTILINE):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def child_ports(parent: int) -> dict[str, int]:
    """``--role pd``'s children and their ``--port``, from their command lines."""
    ports = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and "--role" in argv:
            ports[argv[argv.index("--role") + 1]] = int(argv[argv.index("--port") + 1])
    return ports


def run(args, deployment: str) -> tuple[Row, dict[str, float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(args, deployment, port)
    try:
        wait_healthy(url, proc)
        asyncio.run(warm_up(args, url))
        ports = child_ports(proc.pid) if deployment == "pd" else {}
        before = connector_counters(ports)
        streams, longs = asyncio.run(workload(args, url, random.Random(2)))
        after = connector_counters(ports)
    finally:
        proc.terminate()
        proc.wait(120)
    gaps = [b - a for times in streams for a, b in itertools.pairwise(times[1:])]  # after the first token
    row = (deployment, percentile(gaps, 0.5) * 1e3, percentile(gaps, 0.99) * 1e3, max(gaps) * 1e3,
           statistics.mean(t[1] - t[0] for t in longs), statistics.mean(t[1] - t[0] for t in streams))
    return row, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--num-long", type=int, default=3)
    p.add_argument("--num-streams", type=int, default=3)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--gap", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of streaming before the first long prompt")
    p.add_argument("--batch-tokens", type=int, default=256, help="scheduler.max_num_batched_tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads per deployment (pd: split in two)")
    p.add_argument("--deployments", default="pd,chunked,unchunked")
    args = p.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows, moved = [], {}
    for deployment in args.deployments.split(","):
        row, counters = run(args, deployment)
        print("done:", row, flush=True)
        rows.append(row)
        if deployment == "pd":
            moved = counters
    print(f"\n{args.num_streams} streams x {args.stream_tokens} tokens, {args.num_long} prompts of "
          f"{args.long_tokens} tokens every {args.gap:g} s; {args.model}; {args.threads} threads per deployment")
    print(f"{'deployment':<11} {'TPOT p50 ms':>11} {'TPOT p99 ms':>11} {'TPOT max ms':>11} "
          f"{'long TTFT s':>11} {'stream TTFT s':>13}")
    for name, p50, p99, worst, ttft, stream_ttft in rows:
        print(f"{name:<11} {p50:>11.1f} {p99:>11.1f} {worst:>11.1f} {ttft:>11.2f} {stream_ttft:>13.2f}")
    if moved.get("sent"):
        requests = args.num_long + args.num_streams
        print(f"pd: {moved['sent']:.0f} blocks sent, {moved['bytes_sent'] / requests / 2**20:.1f} MiB per request (mean of {requests}) "
              f"({moved['bytes_sent'] / moved['sent'] / 2**10:.0f} KiB a block), "
              f"{moved['send_us'] / moved['sent'] / 1e3:.2f} ms send time per block; decode side: "
              f"{moved.get('received', 0):.0f} received, {moved.get('hits', 0):.0f} loaded into its pool")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
