"""``lmplug bench serve``: load-test OpenAI-compatible servers (lmplug, llama.cpp's ``llama-server``,
vLLM) the way ``vllm bench serve`` does.

Each request is a streamed ``/v1/completions`` call (``ignore_eos`` so it runs to ``max_tokens``,
usage included); the client records its start, the arrival of every chunk that carries text and
its end. From those: TTFT (start to first token), TPOT ((end - first token) / (output tokens - 1)),
ITL (the gaps between consecutive token chunks, pooled over requests), end-to-end latency, and
their p50 / p90 / p99 (numpy's linear percentiles, vLLM's), throughput, and goodput: requests per
second that meet every ``--slo`` bound. Load is a fixed concurrency, or a Poisson request rate
(exponential gaps, optionally capped by a concurrency), or a sweep of either.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from lmplug.errors import ConfigError

PERCENTILES = (50, 90, 99)


@dataclass
class Workload:
    """The requests of one run: each a prompt (token ids or text) and its ``max_tokens``."""

    prompts: list[list[int] | str]
    output_lens: list[int]


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, token_range: tuple[int, int],
                    seed: int, prefix_len: int = 0) -> Workload:
    """Random token ids: lengths uniform in [len * (1 - ratio), len * (1 + ratio)]; with ``prefix_len``
    every prompt starts with the same ``prefix_len`` ids (the shared-prefix workload)."""
    rng = random.Random(seed)
    low, high = token_range
    prefix = [rng.randrange(low, high) for _ in range(prefix_len)]

    def length(base: int) -> int:
        return max(1, rng.randint(int(base * (1 - range_ratio)), int(base * (1 + range_ratio))))

    prompts: list[list[int] | str] = [prefix + [rng.randrange(low, high) for _ in range(length(input_len))]
                                      for _ in range(n)]
    return Workload(prompts, [length(output_len) for _ in range(n)])


def sharegpt_workload(path: Path, n: int, output_len: int, seed: int) -> Workload:
    """ShareGPT's JSON (``[{"conversations": [{"from": "human", "value": ...}, ...]}]``): each
    conversation's first human turn is a prompt; ``max_tokens`` is ``output_len`` (the reply's
    length in tokens would need the server's tokenizer)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--dataset-path {path}: cannot read ShareGPT JSON ({exc})") from None
    if not isinstance(data, list):
        raise ConfigError(f"--dataset-path {path}: expected a JSON list of {{'conversations': [...]}} entries")
    turns = []
    for entry in data:
        convs = entry.get("conversations") if isinstance(entry, dict) else None
        first = next((c.get("value") for c in convs or [] if isinstance(c, dict) and c.get("from") == "human"), None)
        if isinstance(first, str) and first.strip():
            turns.append(first)
    if not turns:
        raise ConfigError(f"--dataset-path {path}: no conversation has a human turn ('from': 'human', 'value': ...)")
    random.Random(seed).shuffle(turns)
    prompts: list[list[int] | str] = [turns[i % len(turns)] for i in range(n)]
    return Workload(prompts, [output_len] * n)


@dataclass
class RequestRecord:
    """One request's timings (seconds from the run's start) and token counts."""

    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if not self.token_times or self.output_tokens < 2:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        return self.end - self.start


async def _one(client: httpx.AsyncClient, body: dict, t0: float) -> RequestRecord:
    rec = RequestRecord(start=time.perf_counter() - t0)
    try:
        async with client.stream("POST", "/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
            else:
                await _read_stream(resp, rec, t0)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.perf_counter() - t0
    return rec


async def _read_stream(resp: httpx.Response, rec: RequestRecord, t0: float) -> None:
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        usage = event.get("usage")
        if usage:
            rec.prompt_tokens, rec.output_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        if any(c.get("text") for c in event.get("choices") or []):
            rec.token_times.append(time.perf_counter() - t0)
            chunks += 1
    rec.output_tokens = rec.output_tokens or chunks  # a server without usage: one token per chunk


async def run_load(base_url: str, model: str, workload: Workload, *, concurrency: int | None,
                   rate: float = math.inf, seed: int = 0, api_key: str | None = None,
                   timeout: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send every request of ``workload``: at most ``concurrency`` in flight (None: no cap), started
    at a Poisson ``rate`` per second (inf: all at once). Returns the records in order and the wall time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(workload.prompts) or 1)
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def request(prompt, max_tokens: int) -> RequestRecord:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            if gate is None:
                return await _one(client, body, t0)
            async with gate:
                return await _one(client, body, t0)

        tasks = []
        for prompt, out_len in zip(workload.prompts, workload.output_lens):
            tasks.append(asyncio.create_task(request(prompt, out_len)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - t0


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and p50 / p90 / p99 in milliseconds (NaN when there are none)."""
    if not values:
        return {"mean_ms": math.nan, **{f"p{p}_ms": math.nan for p in PERCENTILES}}
    arr = np.asarray(values) * 1000
    return {"mean_ms": float(arr.mean()), **{f"p{p}_ms": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], wall: float, slo: dict[str, float]) -> dict:
    """The run's figures; ``slo``: ``ttft`` / ``tpot`` / ``e2e`` bounds in ms for goodput."""
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if _meets(r, slo)]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok), "wall_s": wall,
        "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
        "goodput": len(good) / wall if slo else None, "slo_ms": slo,
        "ttft": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl": percentiles([g for r in ok for g in r.itls]),
        "e2e": percentiles([r.e2e for r in ok]),
        "first_errors": [r.error for r in records if r.error][:3],
    }


def _meets(rec: RequestRecord, slo: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2e": rec.e2e}
    return all(values[k] is not None and values[k] * 1000 <= bound for k, bound in slo.items())


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500,tpot=50`` (milliseconds) -> ``{"ttft": 500.0, "tpot": 50.0}``."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        try:
            bound = float(value.removesuffix("ms"))
        except ValueError:
            bound = math.nan
        if key not in ("ttft", "tpot", "e2e") or not bound > 0:
            raise ConfigError(f"--slo: {part!r} is not KEY=MS with KEY one of ttft, tpot, e2e and MS > 0 "
                             "(e.g. --slo ttft=500,tpot=50)")
        slo[key] = bound
    return slo


def records_json(records: list[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]
