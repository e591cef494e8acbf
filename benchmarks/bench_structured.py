"""Structured output's cost: constrained against free decoding, and the grammar compile time.

    python benchmarks/bench_structured.py [--model smollm2-135m-instruct] [--backends xgrammar llguidance]
                                         [--batch 1 16] [--tokens 64] [--rounds 3]

For each batch size, the same prompts decode free (``ignore_eos``, so every row runs ``--tokens``
steps) and under a JSON schema whose arrays have no upper bound (so the rows keep going), with
each constraint backend. The engine is driven step by step and only steps without prefill tokens
count: the figure is the median wall time of one decode step (mask filling, which overlaps the
forward on a worker thread, and its application included), and the overhead is its ratio to the
free step's. Configurations take turns within each round so load spikes hit them alike; the load
average is printed first. Then, per backend, the first compile of a schema (a fresh backend, so
its tokenizer tables are built too), a second distinct schema on the same backend, and a cached
lookup of the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from lmplug import LLM, SamplingParams
from lmplug.interfaces.constraint import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]}},
            "required": ["name", "age", "city"]}},
    },
    "required": ["people"],
}
OTHER = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
         "required": ["title", "year"]}
PROMPT = "List some people with their name, age and city as JSON. People:"


def decode_steps(llm: LLM, batch: int, tokens: int, structured: StructuredOutput | None) -> list[float]:
    """Wall time of every decode-only step of one batch (all requests admitted at once)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=structured is None,
                            structured=structured)
    for i in range(batch):
        engine.add_request(f"bench-{time.perf_counter_ns()}-{i}", PROMPT, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.last_stats.get("num_prefill_tokens", 1) == 0:
            times.append(elapsed)
    return times


def compile_times(model: str, backend: str) -> tuple[float, float, float]:
    with LLM(model, structured_output={"backend": backend}) as llm:
        constraint = llm.engine.constraints.backend
        start = time.perf_counter()
        constraint.compile_cached(StructuredOutput(json=SCHEMA))
        first = time.perf_counter() - start
        start = time.perf_counter()
        constraint.compile_cached(StructuredOutput(json=OTHER))
        second = time.perf_counter() - start
        start = time.perf_counter()
        constraint.compile_cached(StructuredOutput(json=SCHEMA))
        cached = time.perf_counter() - start
    return first, second, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; threads {os.environ.get('OMP_NUM_THREADS', 'default')}")

    print("\nfirst-request compile of a JSON schema (fresh backend), a second schema, a cached lookup:")
    for backend in args.backends:
        first, second, cached = compile_times(args.model, backend)
        print(f"  {backend:<11} first {1000 * first:8.1f} ms   second {1000 * second:8.1f} ms   "
              f"cached {1e6 * cached:8.1f} us")

    engines = {name: LLM(args.model, structured_output={"backend": name},
                         scheduler={"backend": "continuous", "max_num_seqs": max(args.batch)})
               for name in args.backends}
    configs = [("free", args.backends[0], None)] + [
        (name, name, StructuredOutput(json=SCHEMA)) for name in args.backends]
    for llm in engines.values():  # warm-up: compile the schema, run one batch
        decode_steps(llm, 1, 4, StructuredOutput(json=SCHEMA))
    print(f"\nmedian decode-step time (ms), {args.tokens} tokens per request, {args.rounds} rounds:")
    print(f"{'batch':>6}" + "".join(f"{name:>14}" for name, _, _ in configs) + "   overhead vs free")
    for batch in args.batch:
        samples: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        for _ in range(args.rounds):
            for name, engine, structured in configs:
                samples[name] += decode_steps(engines[engine], batch, args.tokens, structured)
        med = {name: statistics.median(values) for name, values in samples.items() if values}
        row = f"{batch:>6}" + "".join(f"{1000 * med.get(name, float('nan')):>14.2f}" for name, _, _ in configs)
        row += "   " + "  ".join(f"{name} {100 * (med[name] / med['free'] - 1):+.1f}%"
                                 for name in args.backends if name in med)
        print(row, flush=True)
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
