"""The machine's memory read bandwidth as the benchmarks measure it: GB/s of one pass over a
buffer far larger than the caches (1 GiB), at a given thread count, best of a few passes, in
4 KiB pages and in transparent huge pages.

    python benchmarks/read_bandwidth.py --threads 1 2

The pass is torch's integer sum over the buffer: one add per 8 bytes, so the loop is bound by
the memory, not by arithmetic (it reads about as fast as a plain load loop on the machines
tried). It is the reference the GEMV and decode figures are put against: "weights read at X% of
the read bandwidth" (a decode step reads every weight once). The page size matters: in 4 KiB
pages each page costs a page walk and stops the prefetchers at its end, so a buffer in 2 MiB
pages (``lmplug.kit.hugemem``, as the kernels' weights are) reads faster; the figures say which
they are put against. On a shared machine it moves with the load like every other figure:
measure it in the same sitting as what it is compared to.
"""

from __future__ import annotations

import argparse
import time

PAGES = ("4k", "huge")


def read_bandwidth(threads: int, mib: int = 1024, passes: int = 5, clock=time.perf_counter,
                   pages: str = "4k") -> float:
    """GB/s (1e9 bytes) of the fastest of ``passes`` reads of a ``mib`` MiB buffer on ``threads``
    threads, timed on ``clock`` (``time.process_time``: per second of CPU, which a loaded
    machine's waits for a core do not count in); ``pages``: the buffer in 4 KiB pages (``torch``'s
    memory) or in huge pages (``lmplug.kit.hugemem``, where it gives them: ``huge_pages_granted``)."""
    return Probe(threads, mib, passes, pages, clock)()


class Probe:
    """``read_bandwidth``'s reading with its buffer kept: allocated and written once, then each call
    the best of ``passes`` reads after one unmeasured pass. Small and in huge pages (the defaults:
    256 MiB, about 30 ms a call at 30 GB/s), a quick probe of which bandwidth phase a timed run met
    (``bench_vs_llamacpp.py --phases``): on a VM the bandwidth of two threads can move between
    levels within seconds (the host places the virtual CPUs), which a measurement at the start and
    the end of a run does not see."""

    def __init__(self, threads: int, mib: int = 256, passes: int = 2, pages: str = "huge",
                 clock=time.perf_counter) -> None:
        import torch

        from lmplug.kit import hugemem

        if pages not in PAGES:
            raise ValueError(f"read_bandwidth: pages={pages!r} must be one of {', '.join(PAGES)}")
        self.threads, self.passes, self.clock, self.nbytes = threads, passes, clock, mib * 2**20
        buf = hugemem.empty(self.nbytes) if pages == "huge" else torch.empty(self.nbytes, dtype=torch.uint8)
        self.buf = buf.view(torch.int64)
        self.buf.fill_(1)  # written once: every page is resident

    def __call__(self) -> float:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self.buf.sum()
            best = float("inf")
            for _ in range(self.passes):
                start = self.clock()
                self.buf.sum()
                best = min(best, self.clock() - start)
            return self.nbytes / best / 1e9
        finally:
            torch.set_num_threads(before)


def huge_pages_granted() -> str:
    """Whether the "huge" buffer is in huge pages here: "" when so, else why not (for the reports)."""
    from lmplug.kit import hugemem

    if hugemem.enabled():
        return ""
    mode = hugemem.thp_mode()
    if mode not in ("always", "madvise"):
        return f"transparent huge pages are {mode or 'absent'} here: the huge figure is 4 KiB pages too"
    return "huge pages off (LMPLUG_HUGE_PAGES=0 or not Linux): the huge figure is 4 KiB pages too"


def describe(measured: dict[tuple[int, str], list[float]]) -> str:
    """One line of measured read bandwidths ({(threads, pages): [GB/s, ...]}), by thread count."""
    threads = sorted({t for t, _ in measured})
    text = "; ".join(f"{t} thread(s) " + ", ".join(
        f"{pages} pages {'/'.join(f'{x:.1f}' for x in measured[(t, pages)])}" for pages in PAGES
        if (t, pages) in measured) + " GB/s" for t in threads)
    why = huge_pages_granted()
    return text + (f" ({why})" if why else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    print(describe({(t, pages): [read_bandwidth(t, pages=pages)] for t in args.threads for pages in PAGES}))


if __name__ == "__main__":
    main()
