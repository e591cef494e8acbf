"""What transparent huge pages give the CPU paths that stream memory, beside the GGUF GEMVs
(``bench_gguf_bandwidth.py --pages huge 4k``): each path over the same bytes in 4 KiB pages
(torch's memory) and copied into huge pages (``lmplug.kit.hugemem``), side by side.

    python benchmarks/bench_hugemem.py --threads 1 --rounds 5

- ``mxfp4``: the native MXFP4 expert product (``mxfp4_native.linear``, the best kernel set here)
  over ``--experts`` GPT-OSS-20B experts (gate_up 5760 x 2880, down 2880 x 2880), batch 1;
- ``dense``: the native step's float32 product (``dense_product_f32``, ``lmplug.kit.native_dense``:
  one thread) over 8 layers of 2048 x 2048 float32 ``W^T``, batch 1;
- ``kv``: the paged native decode (``paged_native.paged_decode_attention``) of one sequence of
  ``--context`` tokens, 8 KV heads of 64 (Llama-3.2-1B's), blocks of 16 in random order, bfloat16.

Each reads more bytes than the caches hold. The two page sizes take turns in each of ``--rounds``
rounds; prints the median GB/s of bytes read per call, per wall second and per CPU second, and
huge / 4k. The load average is printed first and last: on a shared machine only ratios from one
sitting mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, same shape and strides (a dense layout), in huge-page memory."""
    from lmplug.kit import hugemem

    flat = hugemem.empty(t.untyped_storage().nbytes()).view(t.dtype)
    out = flat.as_strided(t.shape, t.stride())
    out.copy_(t)
    return out


def mxfp4_case(args, gen):
    from lmplug_quant import mxfp4_native

    kernel = mxfp4_native.load()
    shapes = [(5760, 2880), (2880, 2880)] * args.experts
    weights = [(torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen),
                torch.randint(118, 130, (n, k // 32), dtype=torch.uint8, generator=gen)) for n, k in shapes]
    x = {k: torch.randn(1, k, generator=gen) for _, k in shapes}
    nbytes = sum(b.numel() + s.numel() for b, s in weights)

    def runner(ws):
        return lambda threads: [kernel.linear(x[b.shape[1] * 32], b, s, threads=threads) for b, s in ws]
    huge = [(huge_copy(b), huge_copy(s)) for b, s in weights]
    return nbytes, runner(weights), runner(huge)


def dense_case(args, gen):
    import ctypes

    from lmplug.kit import fused_cpu
    from lmplug.kit.native import NativeCall, call_product
    from lmplug.kit.native_dense import _Dense

    lib = fused_cpu.library()
    if lib is None:
        raise SystemExit("dense: no C compiler: the fused library does not build here")
    k = n = 2048
    wts = [torch.randn(n, k, generator=gen).t().contiguous().t() for _ in range(8)]  # W^T, as Unquantized keeps it
    x = torch.randn(1, k, generator=gen)
    fn = ctypes.cast(lib.dense_product_f32, ctypes.c_void_p).value

    def runner(ws):
        calls = []
        for w in ws:
            desc = _Dense(w.data_ptr(), None, k, n)
            calls.append(NativeCall(fn, ctypes.addressof(desc), (desc, w)))
        return lambda threads: [call_product(call, x, n) for call in calls]
    return sum(w.numel() * 4 for w in wts), runner(wts), runner([huge_copy(w) for w in wts])


def kv_case(args, gen):
    from lmplug_attention.paged import native as paged_native

    heads, kv_heads, dim, block = 32, 8, 64, 16
    blocks = args.context // block
    shape = (blocks, block, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    tables = torch.randperm(blocks, generator=gen).view(1, blocks).to(torch.int32)
    seq_lens = torch.tensor([args.context], dtype=torch.int32)
    q = torch.randn(1, heads, dim, generator=gen).bfloat16()

    def runner(kc, vc):
        return lambda threads: paged_native.paged_decode_attention(q, kc, vc, tables, seq_lens, dim ** -0.5,
                                                                     num_threads=threads)
    nbytes = 2 * k_cache.numel() * 2
    return nbytes, runner(k_cache, v_cache), runner(huge_copy(k_cache), huge_copy(v_cache))


CASES = {"mxfp4": mxfp4_case, "dense": dense_case, "kv": kv_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--experts", type=int, default=4, help="mxfp4: distinct experts")
    parser.add_argument("--context", type=int, default=32768, help="kv: tokens of the sequence")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from read_bandwidth import huge_pages_granted

    print(f"load average before {os.getloadavg()}; {args.threads} thread(s); "
          f"{huge_pages_granted() or 'huge pages granted where asked'}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':6} {'MB a call':>9} {'4k GB/s':>8} {'huge GB/s':>9} {'huge/4k':>8} {'4k CPU':>7} "
          f"{'huge CPU':>8} {'huge/4k CPU':>11}")
    for name in args.cases:
        nbytes, small, huge = CASES[name](args, gen)
        wall: dict[str, list[float]] = {"4k": [], "huge": []}
        cpu: dict[str, list[float]] = {"4k": [], "huge": []}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for pages, fn in (("4k", small), ("huge", huge)):
                t0, c0 = time.perf_counter(), time.process_time()
                fn(args.threads)
                t1, c1 = time.perf_counter(), time.process_time()
                if rnd:
                    wall[pages].append(nbytes / (t1 - t0) / 1e9)
                    cpu[pages].append(nbytes / max(c1 - c0, 1e-9) / 1e9)
        w = {p: statistics.median(v) for p, v in wall.items()}
        c = {p: statistics.median(v) for p, v in cpu.items()}
        print(f"{name:6} {nbytes / 1e6:9.0f} {w['4k']:8.1f} {w['huge']:9.1f} {w['huge'] / w['4k']:7.2f}x "
              f"{c['4k']:7.1f} {c['huge']:8.1f} {c['huge'] / c['4k']:10.2f}x")
        del small, huge
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
