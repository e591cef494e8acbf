"""The machine's memory read bandwidth as the benchmarks measure it: GB/s of one pass over a
buffer far larger than the caches (1 GiB), at a given thread count, best of a few passes.

    python benchmarks/read_bandwidth.py --threads 1 2

The pass is torch's integer sum over the buffer: one add per 8 bytes, so the loop is bound by
the memory, not by arithmetic (it reads about as fast as a plain load loop on the machines
tried). It is the reference the GEMV and decode figures are put against: "weights read at X% of
the read bandwidth" (a decode step reads every weight once). On a shared machine it moves with
the load like every other figure: measure it in the same sitting as what it is compared to.
"""

from __future__ import annotations

import argparse
import time


def read_bandwidth(threads: int, mib: int = 1024, passes: int = 5, clock=time.perf_counter) -> float:
    """GB/s (1e9 bytes) of the fastest of ``passes`` reads of a ``mib`` MiB buffer on ``threads``
    threads, timed on ``clock`` (``time.process_time``: per second of CPU, which a loaded
    machine's waits for a core do not count in)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(mib * 2**20 // 8, dtype=torch.int64)  # written once: every page is resident
        buf.sum()
        best = float("inf")
        for _ in range(passes):
            start = clock()
            buf.sum()
            best = min(best, clock() - start)
        return buf.numel() * 8 / best / 1e9
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    for threads in args.threads:
        print(f"{threads} thread(s): {read_bandwidth(threads):.1f} GB/s")


if __name__ == "__main__":
    main()
