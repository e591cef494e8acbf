"""MoE experts: ``reference`` vs naive loops on this CPU, and ``fused`` (Triton) vs ``reference`` on a GPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py            # CPU section, then the GPU one if any
    python benchmarks/bench_moe.py --tokens 64 256 --experts 8 --hidden 512 --inter 1024 --top-k 2

CPU: one MoE layer's experts (Mixtral-like routing: softmax top-k over
``--experts``, SwiGLU experts of ``--hidden`` x ``--inter``) over T tokens, in
float32, computed three ways after checking that they agree:

- ``per-token``: a Python loop over tokens and their k experts (matrix-vector products);
- ``per-expert``: transformers' shape: a loop over every expert with a token, each
  found with a mask over the whole batch;
- ``reference``: the lmplug backend: pairs sorted by expert once, one grouped matmul
  per expert that received tokens, one ``index_add_`` back.

GPU (CUDA only; otherwise it prints "needs a CUDA GPU"): ``fused`` vs
``reference`` (the per-expert loop: one grouped matmul per expert with tokens) in bf16 at
Mixtral-8x7B sizes (8 experts, top-2, h=4096, I=14336) and DeepSeek-V2-Lite-like sizes
(64 experts, top-6, h=2048, I=1408), from decode batches to long prefills, timed with
``triton.testing.do_bench``, each shape checked (fused against reference) before it is timed;
a mismatch stops the script with exit status 1. ``--json PATH`` writes the GPU rows and the
fused speed-ups over the per-expert loop for ``tools/gpu_check.py``. Run it unchanged on a GPU
machine (without ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu-tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--shapes", nargs="+", default=None, help="GPU shapes (default: all of GPU_SHAPES)")
    p.add_argument("--json", metavar="PATH", help="also write the GPU rows and figures as JSON")
    return p.parse_args(argv)


def make_layer(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
               device: str = "cpu", seed: int = 0):
    from lmplug_moe.routing import select_experts

    from lmplug import RoutingConfig

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) * hidden ** -0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=g, device=device) * inter ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g, device=device)
    ids, weights = select_experts(logits, RoutingConfig(top_k))
    return x, ids, weights, w_gate_up, w_down


def per_token_loop(x, ids, weights, w_gate_up, w_down) -> torch.Tensor:
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            gate, up = (w_gate_up[e] @ x[t]).split(inter)
            out[t] += w * (w_down[e] @ (F.silu(gate) * up))
    return out


def per_expert_masks(x, ids, weights, w_gate_up, w_down) -> torch.Tensor:
    """transformers' MixtralExperts.forward: a mask per expert over the whole batch."""
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w_gate_up.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w_gate_up[e]).split(inter, dim=-1)
        out.index_add_(0, tok, F.linear(F.silu(gate) * up, w_down[e]) * weights[tok, slot, None])
    return out


def best_ms(fns: list, repeats: int) -> list[float]:
    """Best time of each function, run in turns so that a busy machine slows them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats + 1):  # the first round warms up
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [1000 * min(ts[1:]) for ts in times]


def cpu_section(args: argparse.Namespace) -> None:
    from lmplug_moe.reference import reference_experts

    print(f"CPU, float32, {torch.get_num_threads()} threads: {args.experts} experts, top-{args.top_k}, "
          f"h={args.hidden}, I={args.inter} (best of {args.repeats}, ms)")
    print(f"{'tokens':>7}{'per-token':>12}{'per-expert':>12}{'reference':>12}{'vs per-token':>15}"
          f"{'vs per-expert':>15}")
    for tokens in args.tokens:
        case = make_layer(tokens, args.experts, args.top_k, args.hidden, args.inter, torch.float32)
        with torch.inference_mode():
            expected = per_token_loop(*case)
            for fn in (per_expert_masks, reference_experts):
                torch.testing.assert_close(fn(*case), expected, atol=1e-4, rtol=1e-4)
            fns = [per_token_loop, per_expert_masks, reference_experts]
            naive, masks, ref = best_ms([lambda f=f, c=case: f(*c) for f in fns], args.repeats)
        print(f"{tokens:>7}{naive:>12.2f}{masks:>12.2f}{ref:>12.2f}{naive / ref:>14.1f}x{masks / ref:>14.2f}x")


GPU_SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "deepseek-v2-lite": (64, 6, 2048, 1408)}


def gpu_section(args: argparse.Namespace) -> list[dict] | None:
    """The GPU rows (None: a correctness check failed; [] without a GPU)."""
    if not torch.cuda.is_available():
        print("GPU section: needs a CUDA GPU (fused vs reference); skipped")
        return []
    import triton.testing
    from lmplug_moe.fused_kernels import fused_experts
    from lmplug_moe.reference import reference_experts

    shapes = {name: GPU_SHAPES[name] for name in (args.shapes or GPU_SHAPES)}
    print(f"GPU {torch.cuda.get_device_name()}, bfloat16 (triton.testing.do_bench median, ms)")
    print(f"{'shape':<18}{'tokens':>7}{'reference':>12}{'fused':>10}{'speed-up':>10}{'fused TFLOP/s':>15}")
    rows = []
    for shape, (experts, top_k, hidden, inter) in shapes.items():
        for tokens in args.gpu_tokens:
            case = make_layer(tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
            with torch.inference_mode():
                got, want = fused_experts(*case).float(), reference_experts(*case).float()
                err = (got - want).abs().max().item()
                if not err <= 3e-2 * max(1.0, want.abs().max().item()):
                    print(f"correctness check FAILED: {shape} tokens {tokens}: fused vs reference max abs "
                          f"error {err:.3g} (bf16)")
                    return None
                ref = triton.testing.do_bench(lambda c=case: reference_experts(*c))
                fused = triton.testing.do_bench(lambda c=case: fused_experts(*c))
            flops = 2 * tokens * top_k * 3 * hidden * inter
            rows.append({"shape": shape, "tokens": tokens, "reference_ms": ref, "fused_ms": fused,
                         "speedup": ref / fused, "fused_tflops": flops / fused / 1e9})
            print(f"{shape:<18}{tokens:>7}{ref:>12.3f}{fused:>10.3f}{ref / fused:>9.2f}x"
                  f"{flops / fused / 1e9:>15.1f}")
            del case
        torch.cuda.empty_cache()
    print("correctness: fused matches reference on every timed case")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = sorted(set(args.shapes or ()) - set(GPU_SHAPES))
    if unknown:
        raise SystemExit(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(GPU_SHAPES)})")
    if not args.skip_cpu:
        cpu_section(args)
    rows = gpu_section(args)
    if rows is None:
        return 1
    figures = [{"name": f"fused MoE vs per-expert loop, {r['shape']}, {r['tokens']} tokens",
                "value": r["speedup"], "unit": "x"} for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "moe", "device": torch.cuda.get_device_name() if rows else "CPU",
                       "figures": figures, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
