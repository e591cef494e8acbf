"""GGUF CPU GEMV: the native kernels over packed blocks against dense float32 F.linear.

    python benchmarks/bench_gguf_cpu.py [--types Q4_0 Q8_0 ...] [--threads 1 2] [--m 1] [--rounds 10 --head Q8_0]

Batch-1 decode reads every weight once per token, so its floor is (packed bytes) / (memory
bandwidth). For the demo model's (SmolLM2-135M) layer shapes, N x K = out x in, and each ggml
type, prints the time per call of ``gguf_native.mul_mat`` (direct), of the registered torch op
``torch.ops.lmplug_quant.gguf_mul_mat`` (its dispatch included), the GB/s of packed bytes the
direct call reaches, and torch's F.linear over the dense float32 weight (its GB/s of fp32
bytes) at the same thread count, then the sum over one token's matmuls (30 layers of q, k, v,
o, gate, up, down, plus the 49152 x 576 output head) where every shape fits the type: the
k-quants need K % 256 == 0, which 576 is not (llama.cpp stores such tensors in other types).
Weights: random bytes with sane fp16 scales (the speed does not depend on the values).
The load average is printed first: other processes on the machine skew every figure; with
1 thread the ``cpu us`` columns (this thread's CPU time per call, ``time.thread_time``) are
less sensitive to them than wall time. ``--rounds R`` then times R whole tokens of the first
type for each thread count, the counts taking turns, so that load spikes hit them alike: the
min and median wall time, the GB/s of packed bytes at the median, and the median CPU time of the
process (all its threads) per token. Each of a token's matmuls there has its own weight (30 layers
of distinct tensors, as in a decode step: about 100 MB for the 4-bit types, more than the
caches hold), so that the weights come from memory, not from the cache as in the table above;
``--head TYPE`` gives the output head another type (the demo model: Q4_1 layers, Q8_0 head).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # N x K
PER_TOKEN = {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30, (49152, 576): 1}


def random_weight(ggml_type: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    from lmplug_quant.gguf_native import BLOCKS

    elems, size = BLOCKS[ggml_type]
    w = torch.randint(0, 256, (n, k // elems, size), dtype=torch.uint8, generator=gen)
    scale = (torch.rand((n, k // elems, 2), generator=gen) * 0.01 + 1e-3).half().view(torch.uint8)
    at = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 11: [108], 12: [0, 2], 13: [0, 2], 14: [208]}[ggml_type]
    for offset in at:
        w[..., offset:offset + 2] = scale[..., 0:2] if offset == at[0] else scale[..., 0:2].flip(-1)
    return w.reshape(n, -1)


def timed(fn, repeat: int, clock=time.perf_counter) -> float:
    """Median seconds per call over ``repeat`` batches of calls (one warm-up batch), on ``clock``."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    samples = []
    for _ in range(repeat):
        start = clock()
        for _ in range(calls):
            fn()
        samples.append((clock() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    from lmplug_quant import gguf_native

    names = {v: k for k, v in gguf_native.NAMES.items()}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=list(names), choices=list(names))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--m", type=int, default=1, help="activation rows (1: decode)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=0,
                        help="whole tokens per thread count, interleaved (0: none)")
    parser.add_argument("--head", choices=list(names), default=None,
                        help="the output head's type in --rounds (default: the first of --types)")
    args = parser.parse_args()
    ok, why = gguf_native.available()
    if not ok:
        raise SystemExit(f"the native kernels do not build here: {why}")
    kernel = gguf_native.load()
    print(f"load average {os.getloadavg()}; kernels {kernel.isa()} ({os.environ.get('LMPLUG_GGUF_ISA', 'auto')}); "
          f"M={args.m}")
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s)")
        print(f"{'type':6} {'N x K':>11} {'us/call':>8} {'op us':>7} {'GB/s':>6} {'fp32 us':>8} {'fp32 GB/s':>9} "
              f"{'speed-up':>8} {'cpu us':>7} {'cpu GB/s':>8} {'fp32 cpu us':>11}")
        for name in args.types:
            ggml_type = names[name]
            token_s, token_cpu_s, token_fp32_s, complete = 0.0, 0.0, 0.0, True
            for n, k in SHAPES:
                if k % gguf_native.BLOCKS[ggml_type][0]:
                    complete = False
                    continue
                w = random_weight(ggml_type, n, k, gen)
                x = torch.randn(args.m, k, generator=gen)
                dense = torch.randn(n, k, generator=gen)
                call = (x, w, ggml_type, k)
                t = timed(lambda c=call, t=threads: kernel.mul_mat(*c, t), args.repeat)
                t_op = timed(lambda c=call: torch.ops.lmplug_quant.gguf_mul_mat(*c), args.repeat)
                t_fp32 = timed(lambda x=x, d=dense: F.linear(x, d), args.repeat)
                cpu = timed(lambda c=call: kernel.mul_mat(*c, 1), args.repeat, time.thread_time)
                cpu_fp32 = timed(lambda x=x, d=dense: F.linear(x, d), args.repeat, time.thread_time)
                token_s += PER_TOKEN[(n, k)] * t
                token_cpu_s += PER_TOKEN[(n, k)] * cpu
                token_fp32_s += PER_TOKEN[(n, k)] * t_fp32
                print(f"{name:6} {f'{n}x{k}':>11} {t * 1e6:8.1f} {t_op * 1e6:7.1f} {w.numel() / t / 1e9:6.1f} "
                      f"{t_fp32 * 1e6:8.1f} {dense.numel() * 4 / t_fp32 / 1e9:9.1f} {t_fp32 / t:8.2f}"
                      + (f" {cpu * 1e6:7.1f} {w.numel() / cpu / 1e9:8.1f} {cpu_fp32 * 1e6:11.1f}" if threads == 1 else ""))
            if complete:
                print(f"{name:6} one token's matmuls: {token_s * 1e3:.2f} ms (dense fp32 {token_fp32_s * 1e3:.2f} ms), "
                      f"1-thread CPU time {token_cpu_s * 1e3:.2f} ms")
    if args.rounds > 0:
        head = args.head or args.types[0]
        interleaved(kernel, names[args.types[0]], names[head], f"{args.types[0]} (head {head})", args.threads,
                    args.m, args.rounds, gen)
    print(f"\nload average {os.getloadavg()}")


def interleaved(kernel, ggml_type: int, head_type: int, name: str, thread_counts: list[int], m: int, rounds: int,
                gen: torch.Generator) -> None:
    """One token's matmuls, each with its own weight, timed whole, the thread counts taking turns."""
    from lmplug_quant.gguf_native import BLOCKS

    calls = []
    for n, k in SHAPES:
        kind = head_type if n == SHAPES[-1][0] else ggml_type
        if k % BLOCKS[kind][0] == 0:
            x = torch.randn(m, k, generator=gen)
            calls += [(x, random_weight(kind, n, k, gen), kind, k) for _ in range(PER_TOKEN[(n, k)])]
    size = sum(call[1].numel() for call in calls)
    wall: dict[int, list[float]] = {t: [] for t in thread_counts}
    cpu: dict[int, list[float]] = {t: [] for t in thread_counts}
    for _ in range(rounds + 1):  # the first round warms up
        for threads in thread_counts:
            start, start_cpu = time.perf_counter(), time.process_time()
            for call in calls:
                kernel.mul_mat(*call, threads)
            wall[threads].append(time.perf_counter() - start)
            cpu[threads].append(time.process_time() - start_cpu)
    print(f"\n{name}, one token's matmuls ({len(calls)} weights, {size / 1e6:.0f} MB), {rounds} rounds interleaved")
    for threads in thread_counts:
        w, c = wall[threads][1:], cpu[threads][1:]
        print(f"{threads} thread(s): wall min {min(w) * 1e3:.2f} ms, median {statistics.median(w) * 1e3:.2f} ms "
              f"({size / statistics.median(w) / 1e9:.1f} GB/s); process CPU median {statistics.median(c) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
