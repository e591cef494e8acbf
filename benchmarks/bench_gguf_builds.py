"""Two or more builds of the GGUF kernel library side by side in one process: the A/B behind a
kernel change (a prefetch policy, a chunk count) where separate processes disagree by more than
the change (on a shared VM, where a process's memory lands moves its bandwidth by up to 2x).

    cp -r plugins/quant/csrc /tmp/a && cp -r plugins/quant/csrc /tmp/b   # then edit /tmp/b
    python benchmarks/bench_gguf_builds.py --type Q4_K /tmp/a /tmp/b [--rows 1] [--threads 1]
        [--shape 1b] [--layers 6] [--rounds 20] [--isa avx512]

Each folder is a copy of ``plugins/quant/csrc`` (``gguf_cpu.c`` and what it includes), built with
the plugin's flags into the kernel cache. Each build gets its own random weights of ``--layers``
layers of the shape's products (``bench_gguf_bandwidth.SHAPES``, the head left out; more bytes
than the caches hold), bound as a model's layers are (the x86 sets over panels in huge pages,
unless ``LMPLUG_HUGE_PAGES=0``), and the builds take turns a whole token at a time for
``--rounds`` rounds (the first two dropped). Prints GB/s of packed weights per token: wall
min / median and per second of the process's CPU time (all its threads), with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from bench_gguf_bandwidth import SHAPES, random_weight


def main() -> None:
    from lmplug_quant import gguf_native

    from lmplug.kit import native_build
    from lmplug.kit.paths import cache_dir

    names = {v: k for k, v in gguf_native.NAMES.items()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="folders, each a copy of plugins/quant/csrc")
    parser.add_argument("--type", default="Q4_0", choices=list(names))
    parser.add_argument("--shape", default="1b", choices=list(SHAPES))
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1: batch-1 decode)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--isa", default="avx512", help="LMPLUG_GGUF_ISA while binding")
    args = parser.parse_args()
    kind = names[args.type]
    torch.set_num_threads(args.threads)
    parts = {p: nk for p, nk in SHAPES[args.shape].items() if p != "head" and nk[1] % gguf_native.BLOCKS[kind][0] == 0}
    gen = torch.Generator().manual_seed(0)
    os.environ["LMPLUG_GGUF_ISA"] = args.isa
    calls: dict[str, list] = {}
    for folder in args.builds:
        lib, path = native_build.shared_library(Path(folder) / "gguf_cpu.c", gguf_native.FLAGS,
                                                native_build.compiler(), Path(str(cache_dir())))
        kernel = gguf_native.GGUFKernel(lib, path)
        calls[folder] = [(w.numel(), torch.randn(args.rows, k, generator=gen),
                          gguf_native.BoundProduct(kernel, w, kind, k))
                         for _ in range(args.layers) for n, k in parts.values()
                         for w in [random_weight(kind, n, k, gen)]]
    total = sum(size for size, _, _ in calls[args.builds[0]])
    wall: dict[str, list[float]] = {f: [] for f in args.builds}
    cpu: dict[str, list[float]] = {f: [] for f in args.builds}
    load = os.getloadavg()
    for _ in range(args.rounds + 2):
        for folder in args.builds:
            start, start_cpu = time.perf_counter(), time.process_time()
            for _, x, product in calls[folder]:
                product(x)
            wall[folder].append(time.perf_counter() - start)
            cpu[folder].append(time.process_time() - start_cpu)
    print(f"{args.type} {args.shape}, {args.rows} row(s), {args.threads} thread(s), {total / 1e6:.0f} MB a token; "
          f"load average before {load}, after {os.getloadavg()}")
    for folder in args.builds:
        w, c = wall[folder][2:], cpu[folder][2:]
        print(f"{folder:30} wall min {total / min(w) / 1e9:5.1f}  median {total / statistics.median(w) / 1e9:5.1f}"
              f"  per CPU second {total / statistics.median(c) / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
