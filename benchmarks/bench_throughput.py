"""Serving throughput on one seeded workload: lmplug continuous vs lmplug static vs HF transformers.

    python benchmarks/bench_throughput.py [--model smollm2-135m-instruct] [--num-requests 64]

All requests arrive at once (seeded: prompts 16-512 tokens, outputs 16-256
tokens, greedy, EOS ignored so every engine produces exactly the asked
lengths). Engines run one after another in this process, so their figures are
comparable side by side. transformers runs `generate` on padded batches of
`--batch-size` requests in arrival order (a comma list runs each size in turn), for a
GGUF file with the same dense weights as lmplug in `--dtype` (not transformers' packed
GGUF kernels); a batch runs until its longest request is done, and only the tokens each
request asked for count as output.
Reports output tokens/s, and TTFT and TPOT p50/p99 per request, then both lmplug
schedulers' step counts: where a step cost the same whatever its number of rows (a GPU far
from saturation), their ratio is all continuous batching could gain over static here.
Defaults: bfloat16, 32 sequences and 2048 tokens per step, transformers at batch 16, 32, 64.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from lmplug import LLM, SamplingParams
from lmplug.bench import dense_hf_from_gguf
from lmplug.loading.cache import resolve_model


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, min(vocab, 30000)) for _ in range(rng.randint(16, 512))], rng.randint(16, 256))
            for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(name: str, elapsed: float, ttft: list[float], tpot: list[float], out_tokens: int) -> dict:
    row = {"engine": name, "tok/s": out_tokens / elapsed, "TTFT p50": pct(ttft, 0.5), "TTFT p99": pct(ttft, 0.99),
           "TPOT p50": pct(tpot, 0.5), "TPOT p99": pct(tpot, 0.99), "time": elapsed}
    print(f"{name:<22}{row['tok/s']:>9.1f}{row['TTFT p50']:>10.2f}{row['TTFT p99']:>10.2f}"
          f"{1000 * row['TPOT p50']:>10.1f}{1000 * row['TPOT p99']:>10.1f}{elapsed:>9.1f}", flush=True)
    return row


def run_lmplug(model: str, requests, scheduler: str, max_num_seqs: int, budget: int, dtype: str,
               step_stats: bool = False, step_counts: dict | None = None) -> tuple:
    llm = LLM(model, dtype=dtype, max_model_len=1024, scheduler={
        "backend": scheduler, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget},
        kvcache={"backend": "paged", "block_size": 16, "memory_gb": 2.0})
    engine = llm.engine
    start = time.perf_counter()
    for i, (ids, n) in enumerate(requests):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    done, steps = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps.append(dict(engine.last_stats))
    elapsed = time.perf_counter() - start
    if step_counts is not None:
        step_counts[scheduler] = len(steps)
    if step_stats:
        print_step_stats(scheduler, steps)
    ttft = [o.metrics.first_token_time - start for o in done.values()]
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / max(1, len(o.token_ids) - 1)
            for o in done.values()]
    return elapsed, ttft, tpot, sum(len(o.token_ids) for o in done.values())


def print_step_stats(name: str, steps: list[dict]) -> None:
    """Where the time went: steps that computed prompt tokens, then pure decode steps by rows."""
    prefill = [s for s in steps if s["num_prefill_tokens"]]
    print(f"  {name}: {len(prefill)} steps with prompt tokens, {sum(s['step_time_s'] for s in prefill):.1f} s "
          f"({sum(s['num_prefill_tokens'] for s in prefill)} prompt + "
          f"{sum(s['num_decode_tokens'] for s in prefill)} decode tokens)", flush=True)
    for lo, hi in ((1, 4), (5, 12), (13, 24), (25, 10_000)):
        group = [s for s in steps if not s["num_prefill_tokens"] and lo <= s["num_decode_tokens"] <= hi]
        if group:
            t = sum(s["step_time_s"] for s in group)
            rows = sum(s["num_decode_tokens"] for s in group)
            print(f"    decode steps of {lo}-{hi} rows: {len(group)} steps, {t:.1f} s, {rows} tokens, "
                  f"{1000 * t / len(group):.0f} ms/step, {1000 * t / rows:.1f} ms/token", flush=True)


def run_hf(path, requests, batch_size: int, dtype: str) -> tuple:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    if str(path).endswith(".gguf"):
        hf = dense_hf_from_gguf(path, getattr(torch, dtype))
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    ttft, tpot, out_tokens = [], [], 0
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        streamer = Stamps()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                        min_new_tokens=longest, streamer=streamer, pad_token_id=0)
        steps = streamer.times[1:]  # the first call carries the prompt
        for _, n in batch:
            ttft.append(steps[0] - start)
            tpot.append((steps[n - 1] - steps[0]) / max(1, n - 1))
            out_tokens += n
    return time.perf_counter() - start, ttft, tpot, out_tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--batch-size", default="16,32,64", help="transformers' padded batch size; a comma list runs each "
                                                     "(the ratio line then names every one)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--step-stats", action="store_true",
                   help="after each lmplug run: its steps by kind (with prompt tokens / decode by rows), time and tokens")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="both engines' weights and activations (bfloat16 uses the CPU's AMX/AVX-512 units where present)")
    a = p.parse_args()
    path = resolve_model(a.model)
    requests = workload(a.num_requests, 49152)
    print(f"{a.num_requests} requests, {sum(len(r) for r, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens; {a.dtype}; threads {torch.get_num_threads()}")
    print(f"{'engine':<22}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'time s':>9}")
    print(f"{'':<22}{'(output)':>9}{'(s)':>10}{'(s)':>10}{'(ms)':>10}{'(ms)':>10}")
    counts: dict[str, int] = {}
    rows = [report(f"lmplug {name}", *run_lmplug(str(path), requests, name, a.max_num_seqs,
                                                  a.max_num_batched_tokens, a.dtype, a.step_stats, counts))
            for name in ("continuous", "static")]
    if not a.skip_hf:
        for size in (int(b) for b in a.batch_size.split(",")):
            rows.append(report(f"transformers (batch {size})", *run_hf(path, requests, size, a.dtype)))
    base = rows[0]["tok/s"]
    print("continuous / other: " + ", ".join(f"{r['engine']} {base / r['tok/s']:.2f}x" for r in rows[1:]))
    # where every step cost the same whatever its rows (a GPU far from saturation), time would
    # follow the step count: this ratio is what continuous batching alone can gain on this workload
    print(f"engine steps: continuous {counts['continuous']}, static {counts['static']} "
          f"(static / continuous {counts['static'] / counts['continuous']:.2f})")


if __name__ == "__main__":
    main()
