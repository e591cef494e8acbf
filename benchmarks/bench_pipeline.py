"""Pipeline parallelism on the demo model: throughput at 16 concurrent requests for PP=1, PP=2
(and the P x T layouts given), with each stage's bubble.

    python benchmarks/bench_pipeline.py [--layouts 1x1,2x1,3x1,2x3] [--num-requests 16]

All requests arrive at once (seeded prompts of 32-128 tokens, 32 greedy output tokens each, EOS
ignored); every layout runs the same workload one after another in this process, so the figures
compare side by side. A layout ``PxT`` is ``pipeline_parallel_size: P, tensor_parallel_size: T``
(P x T processes, gloo on the CPU). The bubble of a rank is the time it waited for its input
(the previous stage's hidden states; rank 0: the last stage's logits; a worker: its next step)
over its wall time during the run (``lmplug.kit.pipeline.StageClock``).

What a 2-core machine can and cannot show: PP splits the layers, not the work of a step. With
one batch in flight each stage would wait while the others compute (a bubble of (P-1)/P); the
engine keeps up to P micro-batches in flight (``lmplug.engine.virtual``), and the bubble column
shows how much of that wait is left. On 2 cores shared with other processes the stages compete
for the same cores that one process already keeps busy (and gloo's loopback copies take the
rest), so the throughput ratio PP / 1x1 here shows the cost of the pipeline (p2p transfers, one
process per stage, no C decode step across layers), not the speed-up a pipeline across GPUs or
hosts gives, where each stage has its own device. What PP buys on such a machine is memory per
process (``weight_bytes_per_rank``), printed too. Quote ``cat /proc/loadavg`` with the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from lmplug import LLM, SamplingParams

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "kvcache": "paged",
          "scheduler": {"backend": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 512}}


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(rng.randint(32, 128))] for _ in range(n)]


def run(model: str, pp: int, tp: int, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, **ENGINE, parallel={"pipeline_parallel_size": pp, "tensor_parallel_size": tp}) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        group = llm.engine.parallel
        if group is not None:
            group.stage_clocks(reset=True)
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        clocks = group.stage_clocks() if group is not None else None
        weights = llm.engine.memory["weight_bytes_per_rank"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"layout": f"{pp}x{tp}", "tok/s": tokens / elapsed, "time": elapsed, "tokens": tokens,
            "bubble": [round(c["bubble"], 2) for c in clocks] if clocks else [0.0],
            "weights_mb": [round(w / 2**20, 1) for w in weights],
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layouts", default="1x1,2x1,3x1,2x3", help="comma list of PxT")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        print("loadavg:", f.read().strip(), "| cpus:", os.cpu_count())
    prompts = workload(args.num_requests)
    rows = []
    print(f"{'layout':<8}{'tok/s':>9}{'time s':>9}{'vs 1x1':>8}  bubble per rank      weights MiB per rank")
    for layout in args.layouts.split(","):
        pp, tp = (int(x) for x in layout.split("x"))
        row = run(args.model, pp, tp, prompts, args.max_tokens)
        rows.append(row)
        ratio = row["tok/s"] / rows[0]["tok/s"]
        same = "" if row["outputs"] == rows[0]["outputs"] else "  (tokens differ from the first layout)"
        print(f"{row['layout']:<8}{row['tok/s']:>9.1f}{row['time']:>9.1f}{ratio:>8.2f}  "
              f"{row['bubble']!s:<20} {row['weights_mb']}{same}", flush=True)
    with open("/proc/loadavg") as f:
        print("loadavg:", f.read().strip())


if __name__ == "__main__":
    main()
