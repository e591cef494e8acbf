"""MLA decode bandwidth: GB/s of the latent cache read by the Triton kernel, vs the PyTorch reference.

    python benchmarks/bench_mla_decode.py                          # batch 1/16/64 x context 1k/4k/16k, bf16
    python benchmarks/bench_mla_decode.py --batches 1 64 --contexts 4096 --heads 128 --json mla.json
    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python benchmarks/bench_mla_decode.py --interpret-smoke

An MLA decode step (DeepSeek-V2/V3, absorbed form) reads each sequence's cached rows
``[latent | k_pe]`` (``--rank`` + ``--rope`` values per token, one row shared by every head)
once, so its floor is (latent cache bytes) / (memory bandwidth). For every (batch, context) it
first checks ``mla_kernels.mla_decode_latent`` against ``mla_ref.mla_decode_latent`` on the
very inputs it times (blocks of ``--block-size`` rows in random order) and stops with exit
status 1 on a mismatch; then it times both with ``triton.testing.do_bench`` (median) and prints
the kernel's GB/s of latent cache read, that as a share of a plain device copy's bandwidth, and
its speed-up over the reference. ``--json PATH`` writes the rows and the headline figures (for
``tools/gpu_check.py``). Without a CUDA device it prints why and exits 0; ``--interpret-smoke``
checks this script's logic on the CPU under ``TRITON_INTERPRET=1`` at tiny sizes (its timings
mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=16, help="query heads on this GPU (V2-Lite: 16; V3 TP8: 16)")
    p.add_argument("--rank", type=int, default=512, help="kv_lora_rank (the latent width)")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", metavar="PATH", help="also write the rows and figures as JSON")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="CPU check of this script's logic under TRITON_INTERPRET=1 at tiny sizes")
    return p.parse_args(argv)


def copy_bandwidth_gbs(device: str, timer) -> float:
    """Read + write bytes per second of a large device copy: the bandwidth a decode can hope for."""
    src = torch.ones(256 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e9


def make_inputs(batch: int, context: int, args, device: str, dtype: torch.dtype, seed: int = 0):
    """A paged latent cache holding ``context`` rows per sequence (blocks shuffled), and a query
    already absorbed into cache-row space ``[B, H, rank + rope]``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width, bs = args.rank + args.rope, args.block_size
    per_seq = -(-context // bs)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, per_seq).to(device)
    cache = torch.randn(num_blocks, bs, 1, width, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(batch, args.heads, width, generator=gen).to(device=device, dtype=dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, cache, tables, seq_lens, (args.rank + args.rope) ** -0.5


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]


def bench_case(batch: int, context: int, args, device: str, dtype: torch.dtype, timer) -> dict:
    """Check the kernel against the reference on the timed inputs, then time both."""
    from lmplug_attention.mla import kernels as mla_kernels
    from lmplug_attention.mla import ref as mla_ref

    q, cache, tables, seq_lens, scale = make_inputs(batch, context, args, device, dtype)
    with torch.inference_mode():
        got = mla_kernels.mla_decode_latent(q, cache, tables, seq_lens, scale, args.rank)
        want = mla_ref.mla_decode_latent(q, cache, tables, seq_lens, scale, args.rank)
        err = (got.float() - want.float()).abs().max().item()
        limit = tolerance(dtype) * max(1.0, want.float().abs().max().item())
        row = {"batch": batch, "context": context, "max_abs_error": err, "ok": err <= limit}
        if not row["ok"]:
            return row
        kernel_ms = timer(lambda: mla_kernels.mla_decode_latent(q, cache, tables, seq_lens, scale, args.rank,
                                                                max_seq_len=context))
        ref_ms = timer(lambda: mla_ref.mla_decode_latent(q, cache, tables, seq_lens, scale, args.rank,
                                                         max_seq_len=context))
    cache_bytes = batch * context * (args.rank + args.rope) * cache.element_size()
    row.update(kernel_ms=kernel_ms, ref_ms=ref_ms, cache_mb=cache_bytes / 2**20,
               kernel_gbs=cache_bytes / (kernel_ms * 1e-3) / 1e9, ref_gbs=cache_bytes / (ref_ms * 1e-3) / 1e9,
               speedup=ref_ms / kernel_ms)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret_smoke:
        if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
            print("--interpret-smoke runs the kernel on CPU and needs TRITON_INTERPRET=1 in the environment")
            return 2
        device, dtype = "cpu", torch.float32  # bf16 tl.dot is wrong under the interpreter
        args.batches, args.contexts, args.heads, args.rank, args.rope = [1, 3], [40], 4, 32, 16

        def timer(fn) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        name = "CPU (TRITON_INTERPRET=1; timings meaningless)"
    else:
        if not torch.cuda.is_available():
            print("bench_mla_decode.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to time "
                  "here. The kernel's correctness is tested on CPU under TRITON_INTERPRET=1 by "
                  "tests/plugins/attention/test_mla_kernels.py; --interpret-smoke checks this script's logic.")
            return 0
        import triton.testing

        device, dtype = "cuda", DTYPES[args.dtype]
        rep, warmup = (20, 5) if args.quick else (100, 25)

        def timer(fn) -> float:
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        name = torch.cuda.get_device_name()

    copy_gbs = copy_bandwidth_gbs(device, timer)
    print(f"# {name}, {dtype}, heads {args.heads}, latent {args.rank} + rope {args.rope}, block size "
          f"{args.block_size}; copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'batch':>5} {'context':>7} {'cache MB':>9} {'kernel us':>10} {'GB/s':>8} {'of copy':>8} "
          f"{'ref us':>10} {'ref GB/s':>9} {'speed-up':>9}")
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            row = bench_case(batch, context, args, device, dtype, timer)
            rows.append(row)
            if not row["ok"]:
                print(f"correctness check FAILED: batch {batch} context {context}: kernel vs mla_ref max abs "
                      f"error {row['max_abs_error']:.3g} ({dtype})")
                return 1
            row["of_copy"] = row["kernel_gbs"] / copy_gbs
            print(f"{batch:>5} {context:>7} {row['cache_mb']:>9.1f} {row['kernel_ms'] * 1e3:>10.1f} "
                  f"{row['kernel_gbs']:>8.0f} {row['of_copy']:>8.0%} {row['ref_ms'] * 1e3:>10.1f} "
                  f"{row['ref_gbs']:>9.0f} {row['speedup']:>8.2f}x")
            if device == "cuda":
                torch.cuda.empty_cache()
    print("correctness: mla_decode_latent matches mla_ref on every timed case")
    best = max(rows, key=lambda r: r["kernel_gbs"])
    figures = [{"name": f"MLA decode GB/s of latent cache (best: batch {best['batch']}, ctx {best['context']})",
                "value": best["kernel_gbs"], "unit": "GB/s", "fraction_of_copy": best["of_copy"]}]
    figures += [{"name": f"MLA decode batch {r['batch']} ctx {r['context']}: share of copy bandwidth",
                 "value": r["of_copy"], "unit": "fraction"} for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "mla_decode", "device": name, "dtype": str(dtype), "copy_gbs": copy_gbs,
                       "figures": figures, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
