"""Static vs continuous batching (and contiguous vs paged KV) on one mixed workload.

    python benchmarks/bench_batching.py [--model NAME_OR_PATH] [--num-requests 24]

Each configuration runs the same requests (mixed prompt lengths 16-256,
outputs 8-128 tokens, greedy) through `lmplug bench --num-requests`, one
after another in this process; compare the tokens/s lines side by side.
"""

import argparse

from lmplug.cli import main

CONFIGS = [
    ["--scheduler", "static", "--kvcache", "contiguous"],
    ["--scheduler", "continuous", "--kvcache", "contiguous"],
    ["--scheduler", "continuous", "--kvcache", "paged"],
]

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=8)
    a = p.parse_args()
    for extra in CONFIGS:
        print(f"\n== {' '.join(extra)}")
        main(["bench", "--model", a.model, "--num-requests", str(a.num_requests), "--max-model-len", "512",
              "--set", f"scheduler.max_num_seqs={a.max_num_seqs}", *extra])
