"""``flash`` Triton kernels vs ``torch.nn.functional.scaled_dot_product_attention`` on one CUDA GPU.

    python benchmarks/bench_flash_gpu.py                       # fp16 and bf16, head dims 64 and 128
    python benchmarks/bench_flash_gpu.py --lens 1024 4096 --dtypes bf16 --head-dims 128 --quick

For every (dtype, head dim) it first checks the kernels against their PyTorch
references (``prefill_ref``, ``decode_ref``) and SDPA on small inputs and stops with exit status 1
on a mismatch; then it times

- prefill (causal, ``--tokens`` tokens per step: ``tokens // L`` sequences of
  length L, MHA with ``--hidden // head_dim`` heads): TFLOP/s of the varlen
  kernel on packed K/V, of the same attention read through a paged cache,
  of SDPA (each of its backends that runs the case - flash, memory-efficient, cuDNN -
  timed on [B, H, L, D], the fastest kept and named), and the time of flash with
  a sliding window (the tiles behind the window are skipped);
- decode (one token per sequence, GQA ``--kv-heads``, contexts of L keys in
  a paged cache of block size 16): GB/s of K/V read by flash decoding (split-K
  chosen by the kernel) and by SDPA on contiguous [B, Hkv, L, D] caches with
  the query heads grouped per KV head (no K/V repeat, as ``sdpa`` does).

Timings use ``triton.testing.do_bench`` (median ms, launch overhead included:
it dominates the smallest decode cases for both kernels). Without a CUDA
device it prints why and exits 0. ``--json PATH`` writes the rows and the headline figure for
``tools/gpu_check.py``: the worst flash/SDPA-best prefill TFLOP/s ratio at 4k-16k tokens in
bf16 (goal on H100/H200: >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BLOCK_SIZE = 16  # paged cache block size
PREFILL_GOAL = (4096, 16384, 0.9)  # lengths (inclusive) over which flash/SDPA-best TFLOP/s >= goal


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"])
    p.add_argument("--tokens", type=int, default=16384, help="prefill tokens per step (B = tokens // L)")
    p.add_argument("--hidden", type=int, default=2048, help="prefill heads = hidden // head_dim")
    p.add_argument("--heads", type=int, default=32, help="decode query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="decode KV heads")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--window", type=int, default=4096, help="sliding window for the windowed prefill column")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the headline figure as JSON")
    return p.parse_args(argv)


# -- inputs --------------------------------------------------------------------------------------------------

def paged_cache(k: torch.Tensor, v: torch.Tensor, seq_len: int, block_size: int = BLOCK_SIZE):
    """[B*L, Hkv, D] packed K/V -> shuffled paged caches and block tables holding the same keys."""
    num_seqs = k.shape[0] // seq_len
    per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * per_seq
    tables = torch.randperm(num_blocks, device=k.device).to(torch.int32).view(num_seqs, per_seq)
    shape = (num_blocks, block_size, *k.shape[1:])
    k_cache, v_cache = k.new_zeros(shape), v.new_zeros(shape)
    pos = torch.arange(seq_len, device=k.device)
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).flatten()
    k_cache.view(-1, *k.shape[1:])[slots] = k
    v_cache.view(-1, *v.shape[1:])[slots] = v
    return k_cache, v_cache, tables


def tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 4e-3


# -- correctness first ---------------------------------------------------------------------------------------

def check_correctness(dtype: torch.dtype, head_dim: int, device: str) -> list[str]:
    """Small varlen/cached/decode cases against the references and SDPA; returns the failures."""
    from lmplug_attention import decode_ref, prefill_ref
    from lmplug_attention.flash.decode_kernels import flash_decode_with_kvcache
    from lmplug_attention.flash.prefill_kernels import (
        flash_prefill_with_kvcache,
        flash_varlen_attention,
    )

    gen = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, seq_len, scale = 8, 2, 300, head_dim ** -0.5
    lens = [seq_len, 77, 1, 130]
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = rnd(total, heads, head_dim), rnd(total, kv_heads, head_dim), rnd(total, kv_heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    failures = []

    def compare(name, got, want):
        err = (got.float() - want.float()).abs().max().item()
        if not err <= tolerance(dtype) * max(1.0, want.float().abs().max().item()):
            failures.append(f"{name}: max abs error {err:.3g} ({dtype}, head_dim {head_dim})")

    for window in (None, 33):
        got = flash_varlen_attention(q, k, v, cu, scale, sliding_window=window)
        compare(f"varlen window={window} vs prefill_ref", got,
                prefill_ref.varlen_attention(q, k, v, cu, scale, sliding_window=window))
    # SDPA on the first sequence (MHA after repeating K/V: only for this check)
    s = slice(0, seq_len)
    group = heads // kv_heads
    sdpa = F.scaled_dot_product_attention(
        q[s].transpose(0, 1), k[s].repeat_interleave(group, 1).transpose(0, 1),
        v[s].repeat_interleave(group, 1).transpose(0, 1), is_causal=True, scale=scale).transpose(0, 1)
    compare("varlen vs SDPA", flash_varlen_attention(q, k, v, cu, scale)[s], sdpa)
    # the same keys through a paged cache: the last 40 of each sequence as new queries
    k_cache, v_cache, tables = paged_cache(k[:seq_len], v[:seq_len], seq_len)
    q_new = q[seq_len - 40:seq_len]
    cu_new = torch.tensor([0, 40], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    for window in (None, 33):
        got = flash_prefill_with_kvcache(q_new, k_cache, v_cache, tables, cu_new, seq_lens, scale,
                                         sliding_window=window)
        compare(f"cached prefill window={window} vs prefill_ref", got, prefill_ref.prefill_attention(
            q_new, k_cache, v_cache, tables, cu_new, seq_lens, scale, sliding_window=window))
        for splits in (1, 3):
            got = flash_decode_with_kvcache(q[seq_len - 1:seq_len], k_cache, v_cache, tables, seq_lens, scale,
                                            sliding_window=window, num_splits=splits)
            compare(f"decode splits={splits} window={window} vs decode_ref", got, decode_ref.decode_attention(
                q[seq_len - 1:seq_len], k_cache, v_cache, tables, seq_lens, scale, sliding_window=window))
    return failures


# -- timings --------------------------------------------------------------------------------------------------

def best_sdpa_ms(qt, kt, vt, scale: float, timer) -> tuple[float, str]:
    """SDPA's fastest backend on this causal case: (median ms, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = (float("inf"), "none")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        try:
            run()
        except RuntimeError:  # this backend does not take the case (dtype, head dim, GPU)
            continue
        best = min(best, (timer(run), backend.name.lower()))
    if best[1] == "none":
        raise RuntimeError("no SDPA backend runs this case")
    return best


def bench_prefill(args, dtype, head_dim, seq_len, timer, dev: str = "cuda") -> dict:
    from lmplug_attention.flash.prefill_kernels import (
        flash_prefill_with_kvcache,
        flash_varlen_attention,
    )

    batch, heads = max(1, args.tokens // seq_len), max(1, args.hidden // head_dim)
    total, scale = batch * seq_len, head_dim ** -0.5
    q, k, v = (torch.randn(total, heads, head_dim, device=dev, dtype=dtype) for _ in range(3))
    cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    k_cache, v_cache, tables = paged_cache(k, v, seq_len)
    qt, kt, vt = (x.view(batch, seq_len, heads, head_dim).transpose(1, 2).contiguous() for x in (q, k, v))
    flops = 4 * batch * heads * head_dim * seq_len * (seq_len + 1) / 2  # causal: half of QK^T and PV
    sdpa_ms, sdpa_backend = best_sdpa_ms(qt, kt, vt, scale, timer)
    row = {"flash": timer(lambda: flash_varlen_attention(q, k, v, cu, scale, max_seqlen=seq_len)),
           "paged": timer(lambda: flash_prefill_with_kvcache(q, k_cache, v_cache, tables, cu, seq_lens, scale,
                                                             max_query_len=seq_len)),
           "sdpa": sdpa_ms}
    if seq_len > args.window:
        row["window"] = timer(lambda: flash_varlen_attention(q, k, v, cu, scale, sliding_window=args.window,
                                                             max_seqlen=seq_len))
    row["tflops"] = {name: flops / (ms * 1e-3) / 1e12 for name, ms in row.items() if name != "window"}
    row["batch"], row["heads"], row["sdpa_backend"] = batch, heads, sdpa_backend
    return row


def bench_decode(args, dtype, head_dim, seq_len, batch, timer, dev: str = "cuda") -> dict:
    from lmplug_attention.flash.decode_kernels import (
        decode_block_n,
        flash_decode_with_kvcache,
        num_sms,
        plan_decode,
    )

    heads, kv_heads, scale = args.heads, args.kv_heads, head_dim ** -0.5
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    k, v = (torch.randn(batch * seq_len, kv_heads, head_dim, device=dev, dtype=dtype) for _ in range(2))
    k_cache, v_cache, tables = paged_cache(k, v, seq_len)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    # SDPA reads contiguous [B, Hkv, L, D] with the query heads grouped per KV head
    kt, vt = (x.view(batch, seq_len, kv_heads, head_dim).transpose(1, 2).contiguous() for x in (k, v))
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
    row = {"flash": timer(lambda: flash_decode_with_kvcache(q, k_cache, v_cache, tables, seq_lens, scale,
                                                            max_seq_len=seq_len)),
           "sdpa": timer(lambda: F.scaled_dot_product_attention(qg, kt, vt, scale=scale))}
    row["gbps"] = {name: nbytes / (ms * 1e-3) / 1e9 for name, ms in row.items()}
    row["splits"] = plan_decode(batch, kv_heads, seq_len, None, decode_block_n(head_dim), None,
                                num_sms(q.device))[0]
    return row


def print_prefill(row, dtype_name, head_dim, seq_len) -> None:
    t = row["tflops"]
    window = f"{row['window']:9.3f}" if "window" in row else f"{'-':>9}"
    print(f"{dtype_name:5} {head_dim:4} {seq_len:6} {row['batch']:3}x{row['heads']:<3} "
          f"{t['flash']:8.1f} {t['paged']:8.1f} {t['sdpa']:8.1f} {t['flash'] / t['sdpa']:6.2f}x "
          f"{row['flash']:9.3f} {window} {row['sdpa_backend']}")


def print_decode(row, dtype_name, head_dim, seq_len, batch) -> None:
    g = row["gbps"]
    print(f"{dtype_name:5} {head_dim:4} {seq_len:6} {batch:5} {row['splits']:6} "
          f"{g['flash']:9.0f} {g['sdpa']:9.0f} {g['flash'] / g['sdpa']:6.2f}x {row['flash'] * 1e3:9.1f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_flash_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to time "
              "here. The kernels' correctness is tested on CPU under TRITON_INTERPRET=1 by "
              "tests/plugins/attention/test_flash_kernels.py.")
        return 0
    import triton.testing

    rep, warmup = (20, 5) if args.quick else (100, 25)

    def timer(fn) -> float:
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            failures = check_correctness(DTYPES[dtype_name], head_dim, "cuda")
            if failures:
                print("correctness check FAILED:\n  " + "\n  ".join(failures))
                return 1
    print("correctness: flash matches its references and SDPA on every dtype and head dim\n")
    print(f"## prefill, causal (TFLOP/s; window = flash with sliding_window={args.window}, ms)")
    print(f"{'dtype':5} {'D':>4} {'L':>6} {'BxH':7} {'flash':>8} {'paged':>8} {'sdpa':>8} {'ratio':>7} "
          f"{'flash ms':>9} {'window':>9} sdpa backend")
    prefill_rows, decode_rows = [], []
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for seq_len in args.lens:
                row = bench_prefill(args, DTYPES[dtype_name], head_dim, seq_len, timer)
                print_prefill(row, dtype_name, head_dim, seq_len)
                prefill_rows.append({"dtype": dtype_name, "head_dim": head_dim, "len": seq_len, **row,
                                     "ratio": row["tflops"]["flash"] / row["tflops"]["sdpa"]})
            torch.cuda.empty_cache()
    print(f"\n## decode, {args.heads}/{args.kv_heads} heads, paged block {BLOCK_SIZE} (K/V GB/s)")
    print(f"{'dtype':5} {'D':>4} {'L':>6} {'batch':>5} {'splits':>6} {'flash':>9} {'sdpa':>9} {'ratio':>7} "
          f"{'flash us':>9}")
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for batch in args.decode_batches:
                for seq_len in args.lens:
                    row = bench_decode(args, DTYPES[dtype_name], head_dim, seq_len, batch, timer)
                    print_decode(row, dtype_name, head_dim, seq_len, batch)
                    decode_rows.append({"dtype": dtype_name, "head_dim": head_dim, "len": seq_len, "batch": batch,
                                        **row})
            torch.cuda.empty_cache()
    figures = prefill_figures(prefill_rows)
    for f in figures:
        print(f"goal: {f['name']}: {f['value']:.2f}x (goal >= {f['goal']}x)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"bench": "flash_gpu", "device": torch.cuda.get_device_name(), "figures": figures,
                       "prefill": prefill_rows, "decode": decode_rows}, out, indent=1)
    return 0


def prefill_figures(rows: list[dict]) -> list[dict]:
    """Per (dtype, head dim): the worst flash/SDPA-best TFLOP/s ratio over the goal's lengths."""
    lo, hi, goal = PREFILL_GOAL
    figures = []
    for key in dict.fromkeys((r["dtype"], r["head_dim"]) for r in rows):
        picked = [r for r in rows if (r["dtype"], r["head_dim"]) == key and lo <= r["len"] <= hi]
        if picked:
            worst = min(picked, key=lambda r: r["ratio"])
            figures.append({"name": f"flash prefill {key[0]} d{key[1]} TFLOP/s vs SDPA best "
                                    f"(worst at {lo}-{hi}: L={worst['len']}, {worst['sdpa_backend']})",
                            "value": worst["ratio"], "unit": "x", "goal": goal,
                            "met": worst["ratio"] >= goal if key[0] == "bf16" else None})
    return figures


if __name__ == "__main__":
    sys.exit(main())
