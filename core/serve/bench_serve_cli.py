"""``lmplug bench serve``'s flags, the sweep over load points, the table, ``--json`` and ``--plot``.

``--base-url`` once or twice (two servers: each load point runs against both, one after the
other, and the plot has one line per server). ``--concurrency 1,4,16`` or ``--request-rate 1,2,inf``
with more than one value is a sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

from lmplug.errors import ConfigError
from lmplug.serve import bench_serve as bs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmplug bench serve", description="load-test OpenAI-compatible servers "
                                "(vllm bench serve's figures: TTFT, TPOT, ITL, end-to-end latency, goodput)")
    p.add_argument("--base-url", action="append", required=True, metavar="URL",
                   help="a server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (give two to compare)")
    p.add_argument("--label", action="append", help="a name per --base-url for the table and plot")
    p.add_argument("--model", help="the model id to send (default: each server's first /v1/models entry)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset", choices=["random", "prefix", "sharegpt"], default="random")
    p.add_argument("--dataset-path", type=Path, help="sharegpt: the ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per load point")
    p.add_argument("--input-len", type=int, default=128, help="random / prefix: prompt tokens (after the prefix)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens every prompt shares")
    p.add_argument("--token-range", default="10,30000", help="random token ids are drawn from [LOW,HIGH)")
    p.add_argument("--concurrency", default=None, help="requests in flight: N, or N,M,... to sweep")
    p.add_argument("--request-rate", default=None, help="Poisson arrivals per second: R, or R,S,... (inf: "
                   "all at once) to sweep; with --concurrency N as the cap")
    p.add_argument("--slo", help="goodput bounds in ms, e.g. ttft=500,tpot=50 (keys: ttft, tpot, e2e)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the summaries and every request's timings here")
    p.add_argument("--plot", type=Path, help="write a PNG of latency and throughput against load (matplotlib)")
    return p


def _numbers(text: str | None, what: str, kind=float) -> list:
    try:
        return [kind(v) if v.strip() != "inf" else math.inf for v in text.split(",")] if text else []
    except ValueError:
        raise ConfigError(f"--{what}: {text!r} is not a comma-separated list of numbers") from None


def load_points(args: argparse.Namespace) -> list[dict]:
    """Each load point: ``{"concurrency": N or None, "rate": R}``; a sweep runs them in order."""
    conc = _numbers(args.concurrency, "concurrency", int)
    rates = _numbers(args.request_rate, "request-rate")
    if any(c < 1 for c in conc) or any(not r > 0 for r in rates):
        raise ConfigError("--concurrency values must be >= 1 and --request-rate values > 0")
    if rates:
        if len(conc) > 1:
            raise ConfigError("sweep either --concurrency or --request-rate, not both (one --concurrency "
                              "caps a rate sweep)")
        return [{"concurrency": conc[0] if conc else None, "rate": r} for r in rates]
    return [{"concurrency": c, "rate": math.inf} for c in (conc or [1])]


def workload(args: argparse.Namespace) -> bs.Workload:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ConfigError("--num-prompts, --input-len and --output-len must be >= 1")
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise ConfigError("--dataset sharegpt needs --dataset-path FILE.json")
        return bs.sharegpt_workload(args.dataset_path, args.num_prompts, args.output_len, args.seed)
    bounds = _numbers(args.token_range, "token-range", int)
    low, high = (bounds + [0, 0])[:2]
    if len(bounds) != 2 or not 0 <= low < high:
        raise ConfigError(f"--token-range: {args.token_range!r} is not LOW,HIGH with 0 <= LOW < HIGH")
    prefix = args.prefix_len if args.dataset == "prefix" else 0
    return bs.random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                              (low, high), args.seed, prefix)


async def _model_of(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        resp = await client.get("/models")
        if resp.status_code != 200:
            raise ConfigError(f"--base-url {url}: GET /models answered {resp.status_code}; pass --model")
        return resp.json()["data"][0]["id"]


async def run(args: argparse.Namespace) -> list[dict]:
    labels = args.label or []
    if len(args.base_url) > 2 or len(labels) not in (0, len(args.base_url)):
        raise ConfigError("give one or two --base-url, and as many --label as --base-url (or none)")
    labels = labels or [f"server{i + 1}" for i in range(len(args.base_url))]
    points, load, slo = load_points(args), workload(args), bs.parse_slo(args.slo)
    runs = []
    for label, url in zip(labels, args.base_url):
        model = args.model or await _model_of(url, args.api_key)
        for point in points:
            records, wall = await bs.run_load(url.rstrip("/"), model, load, concurrency=point["concurrency"],
                                              rate=point["rate"], seed=args.seed, api_key=args.api_key)
            summary = bs.summarize(records, wall, slo)
            runs.append({"server": label, "base_url": url, "model": model, **point, "summary": summary,
                         "records": bs.records_json(records)})
            print(row(runs[-1]), flush=True)
    return runs


HEADER = ("server      conc   rate  ok/n   req/s  out tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | "
          "ITL p50/p90/p99 ms | E2E p50/p90/p99 ms | goodput")


def row(run: dict) -> str:
    s = run["summary"]

    def trio(key: str) -> str:
        return "/".join(f"{s[key][f'p{p}_ms']:.0f}" for p in bs.PERCENTILES)

    good = "-" if s["goodput"] is None else f"{s['goodput']:.2f}/s"
    conc = "-" if run["concurrency"] is None else str(run["concurrency"])
    return (f"{run['server']:<10} {conc:>5} {run['rate']:>6} {s['completed']}/{s['requests']} "
            f"{s['request_throughput']:7.2f} {s['output_throughput']:10.1f} | {trio('ttft'):>19} | "
            f"{trio('tpot'):>19} | {trio('itl'):>18} | {trio('e2e'):>18} | {good}")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.plot is not None:
        from lmplug.serve.bench_serve_plot import require_matplotlib

        require_matplotlib()  # fail before the run, not after it
    print(HEADER)
    runs = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs}, indent=1, default=str))
    if args.plot is not None:
        from lmplug.serve.bench_serve_plot import plot

        plot(runs, args.plot)
    errors = sum(r["summary"]["errors"] for r in runs)
    for r in runs:
        for err in r["summary"]["first_errors"]:
            print(f"{r['server']}: error: {err}")
    return 1 if errors else 0
