"""MXFP4 expert products on the CPU: GB/s of packed expert weights, per wall second and per CPU
second, for each kernel set and thread count side by side.

    python benchmarks/bench_mxfp4_cpu.py --isas generic avx2 avx512 --threads 1 2

GPT-OSS-20B's expert shapes (gate_up 5760 x 2880, down 2880 x 2880; batch 1: one activation
row), ``--experts`` distinct experts (more bytes than the caches hold, so weights come from
memory as in a decode step), each configuration over weights of its own, the configurations
taking turns in each of ``--rounds`` rounds so that load spikes weigh on all alike. Prints the
median GB/s of packed bytes (blocks + scales) per wall second and per CPU second of the process
(``time.process_time``: every thread, the pool's idle spin included), then the ratios of each
set to the portable one and of 2 threads to 1. The load average is printed first and last: on a
shared machine only ratios from one sitting mean anything.

    python benchmarks/bench_mxfp4_cpu.py --rss model.gguf

instead loads a GGUF GPT-OSS with MXFP4 experts twice, each in a fresh process: packed (the
experts repacked for the ``mxfp4`` method) and ``dequantize_at_load``, and prints the peak RSS
each load added (``ru_maxrss`` after it minus the RSS before it).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}  # N x K, GPT-OSS-20B


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def load_peak(path: str, dequantize: bool) -> dict:
    """In this process: the peak RSS a load of ``path`` adds, and whether its experts stayed packed."""
    from lmplug import LLM

    before = rss_mb()
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64,
              quant={"method": "gguf", "dequantize_at_load": dequantize})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    expert = llm.engine.runner.model.layers[0].mlp.gate_up_proj[0]
    return {"peak_added_mb": round(peak - before, 1), "rss_after_mb": round(rss_mb() - before, 1),
            "packed": "blocks" in dict(expert.named_buffers())}


def rss(path: str) -> None:
    print(f"loadavg {loadavg()}")
    for dequantize in (False, True):
        code = (f"import json, sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); "
                f"import bench_mxfp4_cpu as b; print(json.dumps(b.load_peak({path!r}, {dequantize})))")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        print(("dequantize_at_load" if dequantize else "packed"), json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    from lmplug_quant import mxfp4_native

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isas", nargs="+", default=list(mxfp4_native.ISAS), choices=mxfp4_native.ISAS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--experts", type=int, default=6, help="distinct experts per configuration")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rss", metavar="GGUF", help="peak RSS of loading this GGUF GPT-OSS packed and dequantized")
    args = parser.parse_args()
    if args.rss:
        rss(args.rss)
        return
    kernel = mxfp4_native.load()
    isas = [isa for isa in args.isas if mxfp4_native.ISAS.index(isa) <= mxfp4_native.ISAS.index(kernel.best_isa)]
    print(f"loadavg {loadavg()}  best set: {kernel.best_isa}  sets: {', '.join(isas)}")
    gen = torch.Generator().manual_seed(0)
    configs = [(isa, threads) for isa in isas for threads in args.threads]
    weights = {config: [(torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen),
                         torch.randint(118, 130, (n, k // 32), dtype=torch.uint8, generator=gen))
                        for _ in range(args.experts) for n, k in SHAPES.values()] for config in configs}
    x = {k: torch.randn(1, k, generator=gen) for _, k in SHAPES.values()}
    nbytes = sum(b.numel() + s.numel() for b, s in weights[configs[0]])
    wall: dict = {c: [] for c in configs}
    cpu: dict = {c: [] for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            isa, threads = config
            t0, c0 = time.perf_counter(), time.process_time()
            for blocks, scales in weights[config]:
                kernel.linear(x[blocks.shape[1] * 32], blocks, scales, isa=isa, threads=threads)
            t1, c1 = time.perf_counter(), time.process_time()
            wall[config].append(nbytes / (t1 - t0) / 1e9)
            cpu[config].append(nbytes / max(c1 - c0, 1e-9) / 1e9)
    med = {c: (statistics.median(wall[c]), statistics.median(cpu[c])) for c in configs}
    print(f"{nbytes / 1e6:.1f} MB of packed experts per pass")
    print(f"{'set':8} {'threads':>7} {'GB/s wall':>10} {'GB per CPU s':>13}")
    for (isa, threads), (w, c) in med.items():
        print(f"{isa:8} {threads:7d} {w:10.2f} {c:13.2f}")
    for isa, threads in configs:
        ratios = []
        if isa != "generic" and ("generic", threads) in med:
            ratios.append(f"{isa}/generic {med[isa, threads][0] / med['generic', threads][0]:.2f}x")
        if threads != args.threads[0] and (isa, args.threads[0]) in med:
            ratios.append(f"{threads}/{args.threads[0]} threads {med[isa, threads][0] / med[isa, args.threads[0]][0]:.2f}x")
        if ratios:
            print(f"{isa:8} {threads:7d}  " + ", ".join(ratios))
    print(f"loadavg {loadavg()}")


if __name__ == "__main__":
    main()
