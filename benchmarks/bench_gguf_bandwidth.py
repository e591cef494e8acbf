"""GGUF GEMV at the bandwidth limit: GB/s of packed weights per batch-1 product, kernel sets
and thread counts side by side, against the machine's read bandwidth.

    python benchmarks/bench_gguf_bandwidth.py --shape 1b --types Q4_0 Q4_K Q6_K --isas avx2 avx512 --threads 1 2
    python benchmarks/bench_gguf_bandwidth.py --isas avx2 generic --pages huge 4k   # what huge pages give
    python benchmarks/bench_gguf_bandwidth.py --isas avx2 avxvnni avx512 --rows 5   # a verify's rows

For the shape's products of one decode token (fused q/k/v, o, fused gate/up, down, the tied
head: N x K = out x in), each type and each kernel set (``LMPLUG_GGUF_ISA``, bound as a model's
layer is: the panel sets over their repacked panels), with ``--rows`` activation rows (1: batch-1
decode; a speculative verify's k + 1), times each product of ``--layers`` layers
of distinct weights, then the head, in a decode step's order (more bytes than the caches hold,
so the weights come from memory as in a decode step), the sets and thread counts taking turns in each of ``--rounds``
rounds so that load spikes weigh on all alike. Prints the median GB/s of packed bytes per
product, its share of the read bandwidth in huge pages (``read_bandwidth.py``, measured in 4 KiB
and in huge pages at the start and the end at each thread count; each configuration reads
weights of its own, so none finds another's in the cache), and per set the ratios of interest:
set B / set A at each thread count, 2 threads / 1 thread, and with ``--pages huge 4k`` the
weights bound in huge pages (the default: ``lmplug.kit.hugemem``) / bound with
``LMPLUG_HUGE_PAGES=0`` (the x86 sets' panels in 4 KiB pages, NEON's rows read where they
lie, here torch's memory as a file's mapping would be). The load average is printed first and last: on a shared
machine only ratios from one sitting mean anything. ``token``: all of one token's products together.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from read_bandwidth import PAGES, describe, read_bandwidth

SHAPES = {  # N x K of a token's products (fused where the loader fuses them), and the tied head
    "135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)},
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
           "head": (49152, 2048)},
    "3b": {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192),
           "head": (49152, 3072)},
}


def random_weight(ggml_type: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    from lmplug_quant.gguf_native import BLOCKS

    elems, size = BLOCKS[ggml_type]
    w = torch.randint(0, 256, (n, k // elems, size), dtype=torch.uint8, generator=gen)
    scale = torch.full((n, k // elems, 1), 0.002, dtype=torch.float16).view(torch.uint8)
    at = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 11: [108], 12: [0, 2], 13: [0, 2], 14: [208], 20: [0],
          23: [0]}[ggml_type]
    for offset in at:
        w[..., offset:offset + 2] = scale
    return w.reshape(n, -1)


def bound(kernel, w: torch.Tensor, ggml_type: int, k: int, isa: str, pages: str = "huge"):
    from lmplug_quant import gguf_native

    os.environ["LMPLUG_GGUF_ISA"] = isa
    os.environ["LMPLUG_HUGE_PAGES"] = "1" if pages == "huge" else "0"
    try:
        return gguf_native.BoundProduct(kernel, w, ggml_type, k)
    finally:
        del os.environ["LMPLUG_GGUF_ISA"], os.environ["LMPLUG_HUGE_PAGES"]


def label(isa: str, pages: str) -> str:
    return isa if pages == "huge" else f"{isa}/4k"


def main() -> None:
    from lmplug_quant import gguf_native

    names = {v: k for k, v in gguf_native.NAMES.items()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K", "Q6_K", "Q8_0"], choices=list(names))
    parser.add_argument("--isas", nargs="+", default=list(gguf_native.ISAS[1:]), choices=list(gguf_native.ISAS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rows", type=int, default=1, help="activation rows of each product")
    parser.add_argument("--pages", nargs="+", default=["huge"], choices=PAGES,
                        help="bind the weights in huge pages, in 4 KiB pages (LMPLUG_HUGE_PAGES=0), or both side by side")
    parser.add_argument("--layers", type=int, default=4, help="distinct weights per product shape")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernel = gguf_native.load()
    load_before = os.getloadavg()
    bw = {(t, p): [read_bandwidth(t, pages=p)] for t in args.threads for p in PAGES}
    bw_cpu = {(t, p): [read_bandwidth(t, clock=time.process_time, pages=p)] for t in args.threads for p in PAGES}
    gen = torch.Generator().manual_seed(0)
    results: dict[tuple, list[float]] = {}
    cpu: dict[tuple, list[float]] = {}  # per second of the process's CPU time
    for name in args.types:
        kind = names[name]
        parts = {part: nk for part, nk in SHAPES[args.shape].items() if nk[1] % gguf_native.BLOCKS[kind][0] == 0}
        configs = [(label(isa, p), isa, p, t) for isa in args.isas for p in args.pages for t in args.threads]
        xs = {k: torch.randn(args.rows, k, generator=gen) for _, k in parts.values()}
        calls = {}
        for col, isa, pages, threads in configs:  # each configuration its own weights: none reads another's cache
            # a token's products in order, layer after layer, each with its own weight (then the head)
            token = [(part, random_weight(kind, *parts[part], gen)) for _ in range(args.layers) for part in parts
                     if part != "head"] + [("head", random_weight(kind, *parts["head"], gen))] * ("head" in parts)
            calls[(col, threads)] = [(part, w.numel(), xs[parts[part][1]],
                                      bound(kernel, w, kind, parts[part][1], isa, pages)) for part, w in token]
            del token
        for rnd in range(args.rounds + 1):  # round 0 warms up
            spent: dict[tuple, list[float]] = {}
            for i in range(len(calls[(configs[0][0], configs[0][3])])):  # each product in every configuration in turn
                for isa, _, _, threads in configs:
                    part, size, x, call = calls[(isa, threads)][i]
                    torch.set_num_threads(threads)
                    start, start_cpu = time.perf_counter(), time.process_time()
                    call(x)
                    took, took_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                    for key in ((part, isa, threads), ("token", isa, threads)):
                        acc = spent.setdefault(key, [0, 0.0, 0.0])
                        acc[0] += size
                        acc[1] += took
                        acc[2] += took_cpu
            if rnd:
                for (part, isa, threads), (size, took, took_cpu) in spent.items():
                    results.setdefault((name, part, isa, threads), []).append(size / took / 1e9)
                    cpu.setdefault((name, part, isa, threads), []).append(size / took_cpu / 1e9)
        del calls
    for (t, p), values in bw.items():
        values.append(read_bandwidth(t, pages=p))
        bw_cpu[(t, p)].append(read_bandwidth(t, clock=time.process_time, pages=p))
    ref = {t: statistics.mean(bw[(t, "huge")]) for t in args.threads}
    ref_cpu = {t: statistics.mean(bw_cpu[(t, "huge")]) for t in args.threads}
    print(f"load average before {load_before}; read bandwidth (start/end): {describe(bw)}; "
          f"per CPU second: {describe(bw_cpu)}")
    print(f"{args.shape} shape, {args.rows} activation row(s), median GB/s of packed weights over {args.rounds} interleaved rounds "
          f"({args.layers} layers of distinct weights, then the head); % of the mean read bandwidth in huge pages")
    for title, table, against in (("wall", results, ref),
                                  ("per CPU second (process time: spinning counts)", cpu, ref_cpu)):
        print(f"\nGB/s, {title}")
        print_table(table, args, against)
    print(f"load average after {os.getloadavg()}")


def print_table(results: dict, args: argparse.Namespace, ref: dict[int, float]) -> None:
    labels = [label(isa, p) for isa in args.isas for p in args.pages]
    cols = [(col, t) for col in labels for t in args.threads]
    first, last = label(args.isas[0], args.pages[0]), label(args.isas[-1], args.pages[0])
    both = len(set(args.pages)) == 2
    print(f"{'type':5} {'product':8} {'N x K':>11} " + " ".join(f"{f'{col}/{t}t':>14}" for col, t in cols)
          + "".join(f" {f'{last}/{first} {t}t':>15}" for t in args.threads if first != last)
          + "".join(f" {f'{col} 2t/1t':>12}" for col in labels if {1, 2} <= set(args.threads))
          + "".join(f" {f'{isa} huge/4k {t}t':>17}" for isa in args.isas for t in args.threads if both))
    for name in args.types:
        for part, (n, k) in [*SHAPES[args.shape].items(), ("token", ("", ""))]:
            if (name, part, first, args.threads[0]) not in results:
                continue
            med = {(isa, t): statistics.median(results[(name, part, isa, t)]) for isa, t in cols}
            line = f"{name:5} {part:8} {f'{n}x{k}':>11} " + " ".join(
                f"{med[c]:6.1f} ({100 * med[c] / ref[c[1]]:3.0f}%)" for c in cols)
            line += "".join(f" {med[(last, t)] / med[(first, t)]:14.2f}x" for t in args.threads if first != last)
            if {1, 2} <= set(args.threads):
                line += "".join(f" {med[(col, 2)] / med[(col, 1)]:11.2f}x" for col in labels)
            if both:
                line += "".join(f" {med[(isa, t)] / med[(label(isa, '4k'), t)]:16.2f}x"
                                for isa in args.isas for t in args.threads)
            print(line)


if __name__ == "__main__":
    main()
