"""Paged decode attention bandwidth: GB/s of K/V read, against the device's copy bandwidth.

    python benchmarks/bench_paged_decode.py [--impl auto|triton|cpu|torch] [--dtype bfloat16]

A decode step reads every cached K and V row of each sequence once, so its
floor is (K/V bytes) / (memory bandwidth). For a sweep of (batch, context)
shapes with blocks in random order, prints the time per call, the K/V
GB/s it reaches, and that as a share of a plain device copy's bandwidth
(read + write bytes per second of a large ``copy_``). On CUDA the Triton
kernel runs (split-K chosen automatically; ``--partition-size`` forces
it); on CPU the engine's CPU path (``paged_cpu.py``, its per-step gather index
built inside every timed call) runs at smaller shapes; ``--impl torch`` times the
PyTorch reference instead.
"""

from __future__ import annotations

import argparse
import time

import torch

GPU_SWEEP = [(1, 32768), (4, 16384), (16, 4096), (64, 2048), (256, 1024)]
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


def make_inputs(batch: int, context: int, args, device: torch.device, dtype: torch.dtype):
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.num_heads, args.head_dim, device=device, dtype=dtype)
    return q, k_cache, v_cache, tables, seq_lens


def measure(decode, batch: int, context: int, args, device: torch.device,
            dtype: torch.dtype) -> tuple[int, float]:
    """K/V bytes one decode call reads, and its best time in seconds."""
    q, k_cache, v_cache, tables, seq_lens = make_inputs(batch, context, args, device, dtype)
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * k_cache.element_size()
    seconds = timed(lambda: decode(q, k_cache, v_cache, tables, seq_lens, args.head_dim ** -0.5,
                                   max_seq_len=context, partition_size=args.partition_size), device)
    return kv_bytes, seconds


def decode_fn(impl: str):
    if impl == "cpu":
        from lmplug_attention.paged_cpu import decode_index, paged_decode_attention_cpu

        def decode(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len, partition_size):
            index = decode_index(tables, seq_lens, k_cache.shape[1], k_cache.shape[2], max_seq_len)
            return paged_decode_attention_cpu(q, k_cache, v_cache, index, scale)
        return decode
    if impl == "triton":
        from lmplug_attention.paged_kernels import paged_decode_attention
    else:
        from lmplug_attention.paged_ref import paged_decode_attention
    return paged_decode_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "cpu", "torch"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--partition-size", type=int, default=None, help="force split-K (0: never split)")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impl = args.impl if args.impl != "auto" else ("triton" if device.type == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    decode = decode_fn(impl)
    copy_gbs = copy_bandwidth_gbs(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, {impl}, {dtype}, H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block_size={args.block_size}; copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'batch':>6}{'context':>9}{'KV MB':>9}{'us/call':>10}{'GB/s':>8}{'of copy':>9}")
    for batch, context in GPU_SWEEP if device.type == "cuda" else CPU_SWEEP:
        kv_bytes, seconds = measure(decode, batch, context, args, device, dtype)
        gbs = kv_bytes / seconds / 1e9
        print(f"{batch:>6}{context:>9}{kv_bytes / 2**20:>9.0f}{seconds * 1e6:>10.0f}{gbs:>8.1f}"
              f"{gbs / copy_gbs:>9.0%}")


if __name__ == "__main__":
    main()
