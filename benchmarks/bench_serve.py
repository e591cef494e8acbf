"""Load on ``lmplug serve`` over loopback: throughput and p50/p99 latency (TTFT and total).

    python benchmarks/bench_serve.py                                  # starts `lmplug serve` on the demo model
    python benchmarks/bench_serve.py --num-requests 200 --concurrency 32 --max-tokens 16
    python benchmarks/bench_serve.py --serve-args "--kvcache paged --set scheduler.max_num_seqs=32"
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000/v1 --api-key KEY   # a server already running

``--concurrency`` streaming clients (the openai client, ``lmplug.serve.loadgen``) work through
``--num-requests`` requests, half chat and half completions, each with its own prompt and seed.
Without ``--url`` the server runs in a separate process (``lmplug serve``), as users run it, and
is stopped with SIGTERM at the end; it runs unchanged on a GPU machine (``--serve-args "--device cuda"``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

from lmplug.serve.loadgen import Job, format_summary, run_load, summarize

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "bright", "stars", "watch", "quietly", "from", "far", "above", "the", "silent", "sleeping", "town"]


def make_jobs(count: int, max_tokens: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 24)))
        body = {"max_tokens": max_tokens, "temperature": 0.8, "seed": i}
        if i % 2:
            jobs.append(Job("chat", {**body, "messages": [{"role": "user", "content": text}]}))
        else:
            jobs.append(Job("completion", {**body, "prompt": text}))
    return jobs


def start_server(model: str, extra: list[str], api_key: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "lmplug.cli", "serve", model, "--port", str(port), "--api-key", api_key, *extra]
    print("$", shlex.join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lmplug serve exited with {proc.returncode}")
        try:
            # /health takes the key like every route unless the server makes it public
            if httpx.get(url + "/health", headers={"Authorization": f"Bearer {api_key}"},
                         timeout=1).status_code == 200:
                return proc, url + "/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("lmplug serve did not become healthy in 300 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--url", help="an OpenAI base URL (…/v1) to load instead of starting a server")
    p.add_argument("--api-key", default="bench")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--serve-args", default="--max-model-len 512 --set scheduler.max_num_seqs=32",
                   help="extra flags for `lmplug serve` (quoted)")
    a = p.parse_args()
    proc = None
    url = a.url
    if url is None:
        proc, url = start_server(a.model, shlex.split(a.serve_args), a.api_key)
    try:
        jobs = make_jobs(a.num_requests, a.max_tokens)
        results, wall = asyncio.run(run_load(url, jobs, concurrency=a.concurrency, api_key=a.api_key))
        for r in results:
            if r.error:
                print(f"request {r.index}: {r.error}", file=sys.stderr)
        print(f"[bench_serve] {a.concurrency} streaming clients, max_tokens {a.max_tokens}: "
              f"{format_summary(summarize(results, wall))}")
        return 1 if any(r.error for r in results) else 0
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
