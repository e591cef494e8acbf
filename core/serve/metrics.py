"""Prometheus metrics for ``/metrics``, one registry per server (two apps in one process never mix).

Engine-side figures come from ``LLMEngine.last_stats`` after each step (the
same record the ``lmplug_step_finished`` hook sees); request figures are
observed by the async engine as outputs arrive. prometheus_client is
thread-safe, so the engine thread and the HTTP loop both write here.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lmplug_http_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.client_disconnects = Counter("lmplug_http_client_disconnects", "HTTP requests whose client "
                                          "went away before its answer (counted as status 499)", ["route"],
                                          registry=r)
        self.finished = Counter("lmplug_requests_finished", "Engine requests by finish reason "
                                "(stop, length, abort, error)", ["reason"], registry=r)
        self.prompt_tokens = Counter("lmplug_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("lmplug_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("lmplug_time_to_first_token_seconds", "From request arrival to its "
                              "first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lmplug_time_per_output_token_seconds", "Mean time between output "
                              "tokens after the first, per request", buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("lmplug_request_latency_seconds", "From request arrival to its end",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("lmplug_step_seconds", "Duration of one engine step",
                                   buckets=_TOKEN_BUCKETS, registry=r)
        self.kv_usage = Gauge("lmplug_kv_cache_usage_ratio", "Fraction of the KV cache in use (0-1)",
                              registry=r)
        self.running = Gauge("lmplug_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("lmplug_num_requests_waiting", "Sequences waiting to be scheduled",
                             registry=r)

    def observe_stats(self, stats: dict) -> None:
        """A ``last_stats`` record (or the same keys read after an abort)."""
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        if "step_time_s" in stats:
            self.step_time.observe(stats["step_time_s"])

    def observe_finished(self, reason: str, *, elapsed: float, first_token_after: float | None,
                         num_tokens: int) -> None:
        self.finished.labels(reason=reason).inc()
        self.e2e.observe(elapsed)
        if first_token_after is not None and num_tokens > 1:
            self.tpot.observe((elapsed - first_token_after) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
