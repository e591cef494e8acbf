"""Paged decode attention bandwidth: GB/s of K/V read, against the device's copy bandwidth.

    python benchmarks/bench_paged_decode.py [--impl auto|triton|cpu|native|torch ...] [--dtype bfloat16]
        [--batch 32 --context 16:768]

A decode step reads every cached K and V row of each sequence once, so its
floor is (K/V bytes) / (memory bandwidth). For a sweep of (batch, context)
shapes with blocks in random order, prints the time per call, the K/V
GB/s it reaches, and that as a share of a plain device copy's bandwidth
(read + write bytes per second of a large ``copy_``). On CUDA the Triton
kernel runs (split-K chosen automatically; ``--partition-size`` forces
it); on CPU the engine's CPU path (``paged_cpu.py``, its per-step gather index
built inside every timed call) runs at smaller shapes; ``--impl torch`` times the
PyTorch reference instead, and ``--impl native`` the fused C kernel
(``paged_native.py``, its per-step table preparation inside every timed call).
Several ``--impl`` run side by side on the same inputs, with each one's speed-up
over the first. ``--batch B --context LO:HI`` times one batch whose context lengths
are drawn uniformly from [LO, HI] (seeded), as continuous batching mixes them;
``--context N`` gives every sequence N. Before timing a shape, every implementation's output is
checked against the PyTorch reference (``decode_ref``) on the very inputs it is timed on; a
mismatch stops the script with exit status 1. ``--json PATH`` writes the rows and the headline
figure (the GPU goal: at batch 64, context 4k, bf16, K/V read at >= 80% of copy bandwidth) for
``tools/gpu_check.py``. The demo model's shape, one thread:

    OMP_NUM_THREADS=1 python benchmarks/bench_paged_decode.py --impl cpu torch native \
        --num-heads 9 --num-kv-heads 3 --head-dim 64 --dtype bfloat16 --batch 32 --context 16:768
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

GPU_SWEEP = [(1, 32768), (4, 16384), (16, 4096), (64, 2048), (64, 4096), (256, 1024)]
GOAL = (64, 4096, 0.80)  # batch, context, share of copy bandwidth (bf16, H100/H200)
CPU_SWEEP = [(1, 4096), (8, 1024), (32, 512)]


def copy_bandwidth_gbs(device: torch.device) -> float:
    src = torch.ones(256 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device) / 1e9


def timed(fn, device: torch.device, repeats: int = 10) -> float:
    """Best seconds per call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def context_lengths(batch: int, context: int | tuple[int, int]) -> torch.Tensor:
    """[batch] int32: ``context`` each, or uniform in [lo, hi] for a (lo, hi) pair (seeded)."""
    if isinstance(context, int):
        return torch.full((batch,), context, dtype=torch.int32)
    lo, hi = context
    return torch.randint(lo, hi + 1, (batch,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)


def make_inputs(batch: int, context: int | tuple[int, int], args, device: torch.device, dtype: torch.dtype):
    seq_lens = context_lengths(batch, context)
    blocks_per_seq = -(-int(seq_lens.max()) // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, args.num_heads, args.head_dim, device=device, dtype=dtype)
    return q, k_cache, v_cache, tables, seq_lens.to(device)


def check(decode, inputs, args, dtype: torch.dtype) -> str | None:
    """Why ``decode`` disagrees with the PyTorch reference on ``inputs`` (None: it agrees)."""
    from lmplug_attention.decode_ref import decode_attention

    q, k_cache, v_cache, tables, seq_lens = inputs
    scale, max_seq_len = args.head_dim ** -0.5, int(seq_lens.max())
    got = decode(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=max_seq_len,
                 partition_size=args.partition_size).float()
    want = decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=max_seq_len).float()
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    err = (got - want).abs().max().item()
    return None if err <= tol * max(1.0, want.abs().max().item()) else f"max abs error {err:.3g} ({dtype})"


def measure(decode, inputs, args, device: torch.device) -> tuple[int, float]:
    """K/V bytes one decode call reads, and its best time in seconds."""
    q, k_cache, v_cache, tables, seq_lens = inputs
    kv_bytes = 2 * int(seq_lens.sum()) * args.num_kv_heads * args.head_dim * k_cache.element_size()
    max_seq_len = int(seq_lens.max())
    seconds = timed(lambda: decode(q, k_cache, v_cache, tables, seq_lens, args.head_dim ** -0.5,
                                   max_seq_len=max_seq_len, partition_size=args.partition_size), device)
    return kv_bytes, seconds


def decode_fn(impl: str):
    if impl == "native":
        from lmplug_attention.paged import native as paged_native

        ok, why = paged_native.available()
        if not ok:
            raise SystemExit(f"--impl native: the C kernel is not available here: {why}")
        return paged_native.paged_decode_attention
    if impl == "cpu":
        from lmplug_attention.paged.cpu import decode_index, paged_decode_attention_cpu

        def decode(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len, partition_size):
            index = decode_index(tables, seq_lens, k_cache.shape[1], k_cache.shape[2], max_seq_len)
            return paged_decode_attention_cpu(q, k_cache, v_cache, index, scale)
        return decode
    if impl == "triton":
        from lmplug_attention.paged.kernels import paged_decode_attention

        return paged_decode_attention
    from lmplug_attention.decode_ref import decode_attention

    def reference(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len, partition_size):
        return decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=max_seq_len)
    return reference


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default=["auto"], nargs="+", choices=["auto", "triton", "cpu", "native", "torch"],
                   help="one or more, timed side by side")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--partition-size", type=int, default=None, help="force split-K (0: never split)")
    p.add_argument("--batch", type=int, default=None, help="one batch size instead of the sweep")
    p.add_argument("--context", default=None, help="with --batch: N, or LO:HI for lengths uniform in [LO, HI]")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the headline figure as JSON")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    auto = "triton" if device.type == "cuda" else "cpu"
    impls = list(dict.fromkeys(auto if impl == "auto" else impl for impl in args.impl))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    decoders = {impl: decode_fn(impl) for impl in impls}
    sweep = GPU_SWEEP if device.type == "cuda" else CPU_SWEEP
    if args.batch is not None:
        lo, _, hi = (args.context or "512").partition(":")
        sweep = [(args.batch, (int(lo), int(hi)) if hi else int(lo))]
    copy_gbs = copy_bandwidth_gbs(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, {dtype}, H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block_size={args.block_size}, {torch.get_num_threads()} thread(s); copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'impl':>7}{'batch':>6}{'context':>9}{'KV MB':>9}{'us/call':>10}{'GB/s':>8}{'of copy':>9}"
          f"{'speed-up':>10}")
    rows = []
    for batch, context in sweep:
        inputs = make_inputs(batch, context, args, device, dtype)
        shown = context if isinstance(context, int) else f"{context[0]}:{context[1]}"
        first = None
        for impl, decode in decoders.items():
            problem = check(decode, inputs, args, dtype)
            if problem:
                print(f"correctness check FAILED: {impl} batch {batch} context {shown} vs decode_ref: {problem}")
                return 1
            kv_bytes, seconds = measure(decode, inputs, args, device)
            first = first or seconds
            gbs = kv_bytes / seconds / 1e9
            rows.append({"impl": impl, "batch": batch, "context": shown, "kv_bytes": kv_bytes,
                         "us": seconds * 1e6, "gbs": gbs, "of_copy": gbs / copy_gbs})
            print(f"{impl:>7}{batch:>6}{shown:>9}{kv_bytes / 2**20:>9.0f}{seconds * 1e6:>10.0f}{gbs:>8.1f}"
                  f"{gbs / copy_gbs:>9.0%}{first / seconds:>9.2f}x")
        if device.type == "cuda":
            del inputs
            torch.cuda.empty_cache()
    print("correctness: every implementation matches decode_ref on every timed shape")
    figures = []
    goal_batch, goal_context, goal = GOAL
    for r in rows:
        if (r["batch"], r["context"]) == (goal_batch, goal_context):
            figures.append({"name": f"paged decode ({r['impl']}, {dtype}) batch {goal_batch} ctx {goal_context}: "
                                    "K/V GB/s as a share of copy bandwidth",
                            "value": r["of_copy"], "unit": "fraction", "goal": goal,
                            "met": r["of_copy"] >= goal if device.type == "cuda" and dtype == torch.bfloat16
                            else None})
    if figures:
        print(f"goal: batch {goal_batch}, context {goal_context}: " + ", ".join(
            f"{f['value']:.0%} of copy bandwidth (goal >= {goal:.0%})" for f in figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "paged_decode", "device": name, "dtype": str(dtype), "copy_gbs": copy_gbs,
                       "figures": figures, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
