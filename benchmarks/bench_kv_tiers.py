"""KV tiers: time to first token of a restarted engine whose prefix is on disk, and what a block costs
to move through each connector.

    python benchmarks/bench_kv_tiers.py [--model smollm2-135m-instruct] [--system-tokens 1000]
        [--rounds 3] [--threads 1] [--work-dir DIR]

Restart-warm TTFT: a shared system prompt of ``--system-tokens`` tokens plus a short user turn.
*cold*: a fresh engine with an empty disk tier computes the whole prompt (and writes its blocks
through to the tier); *restarted*: a new engine over the same folder (a new process's view: a new
``LLM``, nothing in its pool) gets a different user turn and loads the shared prefix's blocks from
disk. Both engines are built before the clock starts; each TTFT is one request's add-to-first-token
time, medians over ``--rounds`` (each round a fresh folder), the two interleaved. Per connector
(``host``, ``disk``): bytes per block, put time per block (the write-through, including the copy out
of the pool; ``flush`` included for disk) and get time per block (the load back into the pool).
Prints ``uptime``'s load average before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_prefix_cache import ttft  # the same add-to-first-token clock

from lmplug import LLM


def build(args, connector: dict | None) -> LLM:
    kv = {"backend": "paged", "block_size": args.block_size, "prefix_caching": True}
    extra = {"kvconnector": connector} if connector else {}
    return LLM(args.model, max_model_len=args.system_tokens + args.user_tokens + 64, kvcache=kv, **extra)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def block_costs(args, work: Path) -> list[tuple[str, int, float, float]]:
    """(connector, bytes per block, put ms per block, get ms per block)."""
    rows = []
    for name, options in (("host", {"backend": "host", "memory_gb": 1.0}),
                          ("disk", {"backend": "disk", "path": str(work / "costs")})):
        llm = build(args, options)
        tier = llm.engine.kv.tier
        connector = tier.connector
        blocks = list(range(min(64, llm.engine.kv.num_blocks)))
        nbytes = sum(t.numel() * t.element_size() for t in tier.payload(0).values())
        started = time.perf_counter()
        for i, b in enumerate(blocks):
            connector.put(10**6 + i, tier.payload(b))
        connector.flush()
        put = (time.perf_counter() - started) / len(blocks)
        started = time.perf_counter()
        loaded = tier.load([(b, 10**6 + i) for i, b in enumerate(blocks)])
        get = (time.perf_counter() - started) / len(blocks)
        assert len(loaded) == len(blocks), f"{name}: only {len(loaded)} of {len(blocks)} blocks came back"
        rows.append((name, nbytes, put * 1e3, get * 1e3))
        llm.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work-dir", help="where the disk tiers go (default: a temporary folder)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lmplug-kv-tiers-"))
    print(f"load average before: {load_average()}")

    vocab = build(args, None).engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, vocab, (args.system_tokens,), generator=g).tolist()
    cold_s, warm_s, loaded, computed = [], [], 0, (0, 0)
    for r in range(args.rounds):
        folder = work / f"round{r}"
        shutil.rmtree(folder, ignore_errors=True)
        users = [torch.randint(100, vocab, (args.user_tokens,), generator=g).tolist() for _ in range(2)]
        disk = {"backend": "disk", "path": str(folder)}
        first = build(args, disk)
        t_cold, c_cold = ttft(first, f"cold{r}", system + users[0])
        first.close()  # flushes the tier's pending writes: the "process" ends
        second = build(args, disk)  # the restart: an empty pool over the same folder
        t_warm, c_warm = ttft(second, f"warm{r}", system + users[1])
        loaded = second.engine.kv.tier.blocks_loaded
        second.close()
        cold_s.append(t_cold)
        warm_s.append(t_warm)
        computed = (c_cold, c_warm)
    cold, warm = statistics.median(cold_s), statistics.median(warm_s)
    print(f"{args.model}, {args.system_tokens}-token system prompt + {args.user_tokens}-token user turn, "
          f"block_size {args.block_size}, {args.threads} thread(s), {args.rounds} rounds")
    print(f"{'engine':<12}{'TTFT ms (median)':>18}{'tokens computed':>18}")
    print(f"{'cold':<12}{cold * 1e3:>18.1f}{computed[0]:>18}")
    print(f"{'restarted':<12}{warm * 1e3:>18.1f}{computed[1]:>18}   ({loaded} blocks loaded from disk)")
    print(f"restart-warm TTFT is {cold / warm:.1f}x lower than cold (goal >= 5x)")

    blocks = args.system_tokens // args.block_size
    print(f"\n{'connector':<10}{'bytes/block':>14}{'put ms/block':>14}{'get ms/block':>14}"
          f"{f'MB per {blocks}-block prefix':>26}")
    for name, nbytes, put, get in block_costs(args, work):
        print(f"{name:<10}{nbytes:>14}{put:>14.3f}{get:>14.3f}{nbytes * blocks / 1e6:>26.1f}")
    print(f"load average after: {load_average()}")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
