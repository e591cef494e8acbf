"""``quant`` Triton kernels (W4A16 GPTQ/AWQ, W8A8 fp8/int8) vs a dense cuBLAS matmul on one CUDA GPU.

    python benchmarks/bench_quant_gpu.py                        # fp16 and bf16, Llama-7B-like shapes
    python benchmarks/bench_quant_gpu.py --dtypes bf16 --tokens 1 16 --shapes 4096x11008 --quick
    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python benchmarks/bench_quant_gpu.py --interpret-smoke

For every activation dtype it first checks each kernel against its PyTorch
twin on small inputs and stops with exit status 1 on a mismatch:
``w4a16_gemm`` (the tiled GEMM and, for M <= ``GEMV_MAX_M``, the split-K
GEMV, also with explicit ``split_k``) on GPTQ 4-bit with and without
act-order ``g_idx``, GPTQ 8-bit and AWQ 4-bit against ``gptq_dequantize`` /
``awq_dequantize`` and a float32 matmul; ``w8a8_gemm`` on layers built by the
``fp8`` (per-channel, 128x128 blocks) and ``int8`` (per-channel) methods
quantizing a random float weight at load, with per-token (per-token-group for
blocks) activation scales, against ``scaled_mm_reference``. fp8 needs compute
capability 8.9+; below that its rows are skipped with the reason.

Then, for each weight shape K x N (default: Llama-7B's 4096x4096, 4096x11008,
11008x4096) and each number of tokens M, it times every kernel and
``torch.matmul`` with the dense fp16/bf16 weight (cuBLAS): ms, TFLOP/s
(2*M*N*K), GB/s of weight bytes read (packed values, zeros, scales, g_idx;
the figure that bounds decode) and the speed-up over dense. W4A16 weights are
min/max round-to-nearest per group of ``--group-size`` inputs (the layout is
what is timed, not the quantization). W8A8 rows time the GEMM on quantized
activations; ``apply ms`` adds the per-call activation quantization (PyTorch)
of the layer's ``apply``.

After the table come the headline figures (goals for an H100/H200): the W4A16 GEMV (M=1)
GB/s of packed weight bytes as a share of a plain device copy's bandwidth (goal >= 70%), and
the W8A8 GEMM's speed-up over cuBLAS bf16 at M=1024 (goal >= 1.5x); ``--json PATH`` writes
them with the rows for ``tools/gpu_check.py``.

Timings use ``triton.testing.do_bench`` (median ms). Without a CUDA device it
prints why and exits 0. ``--interpret-smoke`` is a CPU check of this script's
logic under ``TRITON_INTERPRET=1`` at tiny shapes (no bf16: its ``tl.dot``
is wrong under the interpreter; one wall-clock run per case, meaningless as a
speed, instead of ``do_bench``; correctness in fp32 and fp16, timings in fp16), used by
``tests/core/project/test_bench_scripts.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LLAMA_SHAPES = ["4096x4096", "4096x11008", "11008x4096"]
GEMV_GOAL = 0.70  # W4A16 M=1: packed-weight GB/s as a share of copy bandwidth
W8A8_GOAL = (1024, 1.5)  # M, speed-up of the W8A8 GEMM over cuBLAS bf16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=LLAMA_SHAPES, help="weight shapes KxN (in x out)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024], help="M values")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"])
    p.add_argument("--group-size", type=int, default=128, help="W4A16 input rows per scale/zero")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the headline figures as JSON")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="CPU check of this script's logic under TRITON_INTERPRET=1 at tiny shapes")
    return p.parse_args(argv)


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed, relative to the reference's largest value."""
    return {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]


# -- W4A16 weights --------------------------------------------------------------------------------------------

def w4a16_case(k: int, n: int, *, bits: int, group: int, act_order: bool, awq: bool, device: str,
               seed: int = 0) -> dict:
    """A random float ``W [K, N]`` quantized min/max per group of input rows and packed in the GPTQ
    (``lmplug_quant.packing.pack_rows``/``pack_cols``) or AWQ (``AWQ_ORDER``) layout."""
    from lmplug_quant.packing import AWQ_ORDER, pack_cols, pack_rows

    gen = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(k, n, generator=gen) * 0.02).to(device)
    groups = k // group
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:  # act-order: groups are scattered over the input rows
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()
    g_idx = g_idx.to(device)
    rows = torch.argsort(g_idx.long(), stable=True)  # group g's rows are rows[g * group:(g + 1) * group]
    grouped = w[rows].view(groups, group, n)
    maxq = 2**bits - 1
    lo, hi = grouped.amin(1).clamp(max=0), grouped.amax(1).clamp(min=0)
    scales = ((hi - lo) / maxq).clamp(min=1e-6)  # [G, N] float32, as the plugin keeps them
    zeros = torch.round(-lo / scales).clamp(0, maxq).long()
    g = g_idx.long()
    q = torch.clamp(torch.round(w / scales[g]) + zeros[g], 0, maxq).long()
    if awq:
        qweight, qzeros = pack_cols(q, 4, AWQ_ORDER), pack_cols(zeros, 4, AWQ_ORDER)
    else:
        qweight, qzeros = pack_rows(q, bits), pack_cols(zeros, bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.contiguous(), "g_idx": g_idx,
            "bits": bits, "awq_order": awq, "group": group}


def w4a16_dense(case: dict) -> torch.Tensor:
    """The plugin's PyTorch twin: the dequantized float32 ``W [K, N]``."""
    from lmplug_quant.awq import awq_dequantize
    from lmplug_quant.gptq import gptq_dequantize

    if case["awq_order"]:
        return awq_dequantize(case["qweight"], case["qzeros"], case["scales"], case["group"])
    return gptq_dequantize(case["qweight"], case["qzeros"], case["scales"], case["g_idx"], case["bits"])


def w4a16_args(case: dict) -> tuple:
    return case["qweight"], case["qzeros"], case["scales"], case["g_idx"]


W4A16_KINDS = {  # name -> (bits, act_order, awq)
    "gptq4": (4, False, False),
    "gptq4 act-order": (4, True, False),
    "awq4": (4, False, True),
    "gptq8": (8, False, False),
}


# -- W8A8 layers ----------------------------------------------------------------------------------------------

W8A8_KINDS = {  # name -> (method, options)
    "fp8 channel": ("fp8", {}),
    "fp8 block128": ("fp8", {"weight_block_size": [128, 128]}),
    "int8 channel": ("int8", {}),
}


def fp8_problem(device: str) -> str | None:
    """Why fp8 cannot run here (None: it can)."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        return f"fp8 needs compute capability 8.9+ (Ada, Hopper); this GPU is {major}.{minor}"
    return None


def w8a8_layer(method_name: str, options: dict, weight: torch.Tensor, dtype: torch.dtype):
    """A linear layer of ``weight [N, K]`` through the method's own quantize-at-load path on the
    weight's device, ``kernel: triton``; returns (method, layer)."""
    from lmplug.plugins import get_registry

    cls = get_registry().get("quant", method_name).cls
    method = cls(cls.Options(kernel="triton", **options))
    layer = torch.nn.Module()
    n, k = weight.shape
    layer.in_features, layer.out_features = k, n
    method.create_weights(layer, k, n, dtype, bias=False)
    layer.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    method.process_weights_after_loading(layer)
    if layer.path != "triton":
        raise RuntimeError(f"{method_name} {options}: the layer took the {layer.path!r} path, not triton")
    return method, layer


def w8a8_operands(method, layer, x: torch.Tensor) -> tuple:
    """(qa, sa, qweight, w_scale, group_k): what ``apply`` hands ``w8a8_gemm``."""
    from lmplug_quant.w8a8_common import quantize_activations

    qa, sa = quantize_activations(x, method.scheme, layer.group_k)
    return qa, sa, layer.qweight, layer.w_scale, layer.group_k


# -- correctness first ----------------------------------------------------------------------------------------

def check_correctness(dtype: torch.dtype, device: str, shape: tuple[int, int] = (256, 96),
                      tokens: tuple[int, ...] = (1, 3, 20), group: int = 64) -> tuple[list[str], list[str]]:
    """Every kernel against its PyTorch twin on small inputs; returns (failures, skipped)."""
    from lmplug_quant.w4a16_kernels import GEMV_MAX_M, w4a16_gemm, w4a16_gemv
    from lmplug_quant.w8a8_common import scaled_mm_reference
    from lmplug_quant.w8a8_kernels import w8a8_gemm

    k, n = shape
    gen = torch.Generator(device="cpu").manual_seed(1)
    failures, skipped = [], []

    def compare(name, got, want):
        want = want.float()
        err = (got.float() - want).abs().max().item()
        if not err <= tolerance(dtype) * max(1e-6, want.abs().max().item()):
            failures.append(f"{name}: max abs error {err:.3g} (reference max {want.abs().max().item():.3g}, "
                            f"{dtype}, K={k} N={n})")

    for name, (bits, act_order, awq) in W4A16_KINDS.items():
        case = w4a16_case(k, n, bits=bits, group=group, act_order=act_order, awq=awq, device=device)
        dense = w4a16_dense(case)
        for m in tokens:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            want = x.float() @ dense
            path = "gemv" if m <= GEMV_MAX_M else "gemm"
            compare(f"{name} w4a16_gemm M={m} ({path}) vs dequantize + matmul",
                    w4a16_gemm(x, *w4a16_args(case), bits=bits, awq_order=awq), want)
            if m <= GEMV_MAX_M:
                for split_k in (1, 3):
                    compare(f"{name} w4a16_gemv M={m} split_k={split_k}",
                            w4a16_gemv(x, *w4a16_args(case), bits=bits, awq_order=awq, split_k=split_k), want)
    weight = torch.randn(n, k, generator=gen).to(device) * 0.02
    for name, (method_name, options) in W8A8_KINDS.items():
        why = fp8_problem(device) if method_name == "fp8" else None
        if why:
            skipped.append(f"{name}: {why}")
            continue
        method, layer = w8a8_layer(method_name, options, weight, dtype)
        for m in tokens:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            qa, sa, qw, sw, group_k = w8a8_operands(method, layer, x)
            want = scaled_mm_reference(qa, sa, qw, sw, group_k)
            compare(f"{name} w8a8_gemm M={m} vs scaled_mm_reference",
                    w8a8_gemm(qa, sa, qw, sw, group_k=group_k, out_dtype=dtype), want)
            compare(f"{name} layer apply M={m} vs scaled_mm_reference", method.apply(layer, x), want)
    return failures, skipped


# -- timings --------------------------------------------------------------------------------------------------

def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_shape(args, dtype: torch.dtype, k: int, n: int, timer, device: str) -> list[dict]:
    """Rows {kernel, m, ms, apply_ms, weight_bytes} for one weight shape and activation dtype."""
    from lmplug_quant.w4a16_kernels import w4a16_gemm
    from lmplug_quant.w8a8_kernels import w8a8_gemm

    rows = []
    xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in args.tokens}
    dense = (torch.randn(n, k, device=device) * 0.02).to(dtype)  # nn.Linear's [out, in]
    dense_t = dense.T
    for m, x in xs.items():
        rows.append({"kernel": "dense (cuBLAS)", "m": m, "ms": timer(lambda x=x: torch.matmul(x, dense_t)),
                     "weight_bytes": nbytes(dense)})
    for name, (bits, act_order, awq) in W4A16_KINDS.items():
        case = w4a16_case(k, n, bits=bits, group=args.group_size, act_order=act_order, awq=awq, device=device)
        packed = w4a16_args(case)
        wb = nbytes(*packed)
        for m, x in xs.items():
            ms = timer(lambda x=x, packed=packed, bits=bits, awq=awq:
                       w4a16_gemm(x, *packed, bits=bits, awq_order=awq))
            rows.append({"kernel": name, "m": m, "ms": ms, "weight_bytes": wb})
    for name, (method_name, options) in W8A8_KINDS.items():
        if method_name == "fp8" and fp8_problem(device):
            continue
        method, layer = w8a8_layer(method_name, options, dense, dtype)
        wb = nbytes(layer.qweight, layer.w_scale)
        for m, x in xs.items():
            qa, sa, qw, sw, group_k = w8a8_operands(method, layer, x)
            ms = timer(lambda qa=qa, sa=sa, qw=qw, sw=sw, gk=group_k:
                       w8a8_gemm(qa, sa, qw, sw, group_k=gk, out_dtype=dtype))
            apply_ms = timer(lambda x=x, method=method, layer=layer: method.apply(layer, x))
            rows.append({"kernel": name, "m": m, "ms": ms, "apply_ms": apply_ms, "weight_bytes": wb})
    return rows


def print_rows(rows: list[dict], dtype_name: str, k: int, n: int) -> None:
    base = {r["m"]: r["ms"] for r in rows if r["kernel"].startswith("dense")}
    for r in rows:
        m, ms = r["m"], r["ms"]
        tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
        gbps = r["weight_bytes"] / (ms * 1e-3) / 1e9
        apply = f"{r['apply_ms']:9.4f}" if "apply_ms" in r else f"{'-':>9}"
        print(f"{dtype_name:5} {k:6} {n:6} {m:5} {r['kernel']:16} {ms:9.4f} {tflops:8.2f} {gbps:8.0f} "
              f"{base[m] / ms:7.2f}x {apply}")


def copy_bandwidth_gbs(device: str, timer) -> float:
    """Read + write bytes per second of a large device copy: the bandwidth a GEMV can hope for."""
    src = torch.ones(256 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e9


def headline_figures(rows: list[dict], copy_gbs: float, on_gpu: bool) -> list[dict]:
    """W4A16 GEMV (M=1) share of copy bandwidth; W8A8 speed-up over cuBLAS bf16 at M=1024."""
    figures = []
    base = {(r["dtype"], r["k"], r["n"], r["m"]): r["ms"] for r in rows if r["kernel"].startswith("dense")}
    for r in rows:
        shape = f"{r['dtype']} K={r['k']} N={r['n']}"
        if r["m"] == 1 and r["kernel"] in W4A16_KINDS:
            share = r["weight_bytes"] / (r["ms"] * 1e-3) / 1e9 / copy_gbs
            figures.append({"name": f"W4A16 GEMV {r['kernel']} M=1 {shape}: packed GB/s as a share of copy",
                            "value": share, "unit": "fraction", "goal": GEMV_GOAL,
                            "met": share >= GEMV_GOAL if on_gpu else None})
        if r["m"] == W8A8_GOAL[0] and r["kernel"] in W8A8_KINDS:
            speedup = base[r["dtype"], r["k"], r["n"], r["m"]] / r["ms"]
            figures.append({"name": f"W8A8 {r['kernel']} M={r['m']} {shape}: speed-up over cuBLAS",
                            "value": speedup, "unit": "x", "goal": W8A8_GOAL[1],
                            "met": speedup >= W8A8_GOAL[1] if on_gpu and r["dtype"] == "bf16" else None})
    return figures


def parse_shape(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not KxN (e.g. 4096x11008)") from None
    return k, n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret_smoke:
        if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
            print("--interpret-smoke runs the kernels on CPU and needs TRITON_INTERPRET=1 in the environment")
            return 2
        device = "cpu"
        check_dtypes, args.dtypes = ["fp32", "fp16"], ["fp16"]
        args.shapes, args.tokens, args.group_size = ["128x64"], [1, 20], 32

        def timer(fn) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    else:
        if not torch.cuda.is_available():
            print("bench_quant_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to time "
                  "here. The kernels' correctness is tested on CPU under TRITON_INTERPRET=1 by "
                  "tests/plugins/quant/test_w4a16_kernels.py and tests/plugins/quant/test_quant_layers.py; --interpret-smoke checks this "
                  "script's logic there.")
            return 0
        import triton.testing

        device = "cuda"
        rep, warmup = (20, 5) if args.quick else (100, 25)

        def timer(fn) -> float:
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

        print(f"# {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
              f"torch {torch.__version__}")
        check_dtypes = args.dtypes
    shapes = [parse_shape(s) for s in args.shapes]
    skipped: list[str] = []
    for dtype_name in check_dtypes:
        tokens = (1, 3, 20) if device == "cpu" else (1, 4, 20, 100)  # GEMV, GEMM with 16-/64-row tiles
        failures, skipped = check_correctness(DTYPES[dtype_name], device, tokens=tokens)
        if failures:
            print("correctness check FAILED:\n  " + "\n  ".join(failures))
            return 1
    print("correctness: w4a16_gemm/gemv (GPTQ 4/8-bit, act-order, AWQ) and w8a8_gemm match their PyTorch "
          "twins on every dtype")
    for line in skipped:
        print(f"skipped: {line}")
    print(f"\n## weight x activation GEMM y[M, N] = x[M, K] @ W (ms; TFLOP/s; GB/s of weight bytes read; "
          f"speed-up over dense; W4A16 group {args.group_size}; apply ms = W8A8 layer incl. activation "
          f"quantization)")
    print(f"{'dtype':5} {'K':>6} {'N':>6} {'M':>5} {'kernel':16} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8} "
          f"{'vs dense':>8} {'apply ms':>9}")
    all_rows = []
    for dtype_name in args.dtypes:
        for k, n in shapes:
            rows = bench_shape(args, DTYPES[dtype_name], k, n, timer, device)
            print_rows(rows, dtype_name, k, n)
            all_rows += [{**r, "dtype": dtype_name, "k": k, "n": n} for r in rows]
            if device == "cuda":
                torch.cuda.empty_cache()
    copy_gbs = copy_bandwidth_gbs(device, timer)
    figures = headline_figures(all_rows, copy_gbs, device == "cuda")
    print(f"\n## headline figures (copy bandwidth {copy_gbs:.0f} GB/s)")
    for f in figures:
        shown = (f"{f['value']:.0%} (goal >= {f['goal']:.0%})" if f["unit"] == "fraction"
                 else f"{f['value']:.2f}x (goal >= {f['goal']:g}x)")
        print(f"goal: {f['name']}: {shown}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"bench": "quant_gpu", "device": device, "copy_gbs": copy_gbs, "figures": figures,
                       "rows": all_rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
