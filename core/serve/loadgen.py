"""A bounded load generator for an OpenAI-compatible server (used by ``benchmarks/bench_serve.py``
and the load test): ``concurrency`` streaming clients work through a list of jobs.

Needs the ``openai`` package (``pip install openai``, in lmplug's ``dev`` extra).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One request: ``kind`` is ``"chat"`` (``body`` has ``messages``) or ``"completion"`` (``prompt``)."""

    kind: str
    body: dict[str, Any]


@dataclass
class Result:
    index: int
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int = 0
    ttft: float | None = None  # seconds to the first chunk carrying text
    latency: float = 0.0
    error: str | None = None


async def _one(client: Any, model: str, index: int, job: Job) -> Result:
    result = Result(index)
    started = time.perf_counter()
    try:
        create = client.chat.completions.create if job.kind == "chat" else client.completions.create
        stream = await create(model=model, stream=True, stream_options={"include_usage": True}, **job.body)
        async for chunk in stream:
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text = (choice.delta.content if job.kind == "chat" else choice.text) or ""
                if text and result.ttft is None:
                    result.ttft = time.perf_counter() - started
                result.texts[choice.index] = result.texts.get(choice.index, "") + text
                if choice.finish_reason is not None:
                    result.finish_reasons[choice.index] = choice.finish_reason
    except Exception as exc:  # noqa: BLE001 - a load test reports failures, it does not stop on one
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - started
    return result


async def run_load(base_url: str, jobs: list[Job], *, concurrency: int = 32, api_key: str = "none",
                   model: str | None = None, timeout: float = 600.0) -> tuple[list[Result], float]:
    """Run every job with ``concurrency`` clients in flight; return results in job order and the wall time."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    if model is None:
        model = (await client.models.list()).data[0].id
    todo = asyncio.Queue()
    for item in enumerate(jobs):
        todo.put_nowait(item)
    results: list[Result | None] = [None] * len(jobs)

    async def worker() -> None:
        while not todo.empty():
            index, job = todo.get_nowait()
            results[index] = await _one(client, model, index, job)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    await client.close()
    return [r for r in results if r is not None], wall


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    latencies = [r.latency for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * _pct(ttfts, 50), "ttft_p99_ms": 1000 * _pct(ttfts, 99),
        "latency_p50_ms": 1000 * _pct(latencies, 50), "latency_p99_ms": 1000 * _pct(latencies, 99),
    }


def format_summary(s: dict[str, float]) -> str:
    return (f"{s['requests']:.0f} requests, {s['errors']:.0f} errors in {s['wall_s']:.1f} s | "
            f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tokens/s | "
            f"TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms | "
            f"total p50 {s['latency_p50_ms']:.0f} ms p99 {s['latency_p99_ms']:.0f} ms")
