"""Offline quantizers side by side on one model: size, perplexity, KL vs the float model, speed.

    OMP_NUM_THREADS=1 python benchmarks/bench_quant.py [--model PATH.gguf|HF_DIR] [--cache /tmp/q]
        [--methods rtn,gptq,awq,smoothquant,fp8] [--bits 4] [--group-size 64]
        [--eval-tokens 4096] [--window 512] [--decode-tokens 48]

Each method's folder is made once with ``lmplug quantize`` into ``CACHE/<method>`` (an existing
folder is reused; its quantize time is then not shown). Held-out text: the pydoc topics the
calibration did not use (``lmplug_quant.quantizers.calibration``), written to
``CACHE/heldout.txt``. Then one table: method, linear-weight MB, bytes vs fp16, perplexity, mean
KL(P_fp32 || P_method) over the same positions (``lmplug.evaluate``), and decode tokens/s at
batch 1 (greedy, after the first token, median of repeats, alternating methods) relative to the
fp32 model, all through lmplug's engine in this one process. A W8A8 folder (smoothquant, fp8)
whose compressed-tensors method is not installed is scored by the PyTorch fake-quant reference
(``fakequant.W8A8Reference``), marked ``ref``, and gets no speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lmplug.evaluate import Scorer, evaluate
from lmplug.loading import open_source
from lmplug.loading.cache import resolve_model

DEMO = "smollm2-135m-instruct"
INT4 = ("rtn", "gptq", "awq")


def make_folder(model: str, out: Path, method: str, args) -> float | None:
    from lmplug.cli import main

    if out.exists():
        return None
    flags = ["--bits", str(args.bits), "--group-size", str(args.group_size)] if method in INT4 else []
    started = time.perf_counter()
    rc = main(["quantize", model, str(out), "--method", method, *flags])
    if rc:
        raise SystemExit(f"lmplug quantize --method {method} failed ({rc})")
    return time.perf_counter() - started


def linear_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of the quantized linears' tensors, fp16 bytes of the same weights)."""
    from safetensors import safe_open

    quant = fp16 = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        names = {k.rsplit(".", 1)[0] for k in keys if k.endswith((".qweight", ".weight_scale"))}
        for k in keys:
            if k.rsplit(".", 1)[0] in names and not k.endswith(".bias"):
                t = f.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                quant += n * {"I32": 4, "F16": 2, "BF16": 2, "F32": 4, "I8": 1, "F8_E4M3": 1}[t.get_dtype()]
    cfg = json.loads((folder / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    fp16 = 2 * per_layer * cfg["num_hidden_layers"]
    return quant, fp16


def loadable(folder: Path) -> bool:
    from lmplug.plugins import get_registry

    method = json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"]
    return method in get_registry().backends("quant")


def decode_tps(llms: dict, prompt: list[int], new_tokens: int, repeats: int) -> dict[str, float]:
    from lmplug import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {k: [] for k in llms}
    for _ in range(repeats):
        for name, llm in llms.items():  # alternate, so machine noise hits all alike
            stamps = []
            for out in llm.stream(prompt, params):
                stamps.extend([time.perf_counter()] * len(out.delta_token_ids))
            times[name].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {k: 1 / statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEMO)
    p.add_argument("--cache", default="/tmp/q")
    p.add_argument("--methods", default="rtn,gptq,awq,smoothquant,fp8")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from lmplug_quant.quantizers.calibration import heldout_text
    from lmplug_quant.quantizers.fakequant import W8A8Reference

    model = str(resolve_model(args.model))
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    made = {m: make_folder(model, cache / m, m, args) for m in methods}
    text = cache / "heldout.txt"
    text.write_text(heldout_text())

    print(f"threads: {torch.get_num_threads()}; model: {model}; held-out text: {text}", flush=True)
    reference = Scorer(model, window=args.window)
    tokens = reference.tokenizer.encode(text.read_text(), add_special_tokens=False)[:args.eval_tokens]
    stride = args.window // 2
    rows = [("fp32", None, 1.0, evaluate(reference, tokens, args.window, stride), "lmplug")]
    llms = {"fp32": reference.llm}
    for m in methods:
        folder = cache / m
        if loadable(folder):
            scorer, how = Scorer(str(folder), window=args.window), "lmplug"
            llms[m] = scorer.llm
        else:
            scorer, how = W8A8Reference(open_source(folder), max_len=args.window + 1), "ref"
        q, fp16 = linear_bytes(folder)
        rows.append((m, q, q / fp16, evaluate(scorer, tokens, args.window, stride, reference), how))
        print(f"  evaluated {m} ({how})", flush=True)
    prompt = tokens[:64]
    tps = decode_tps(llms, prompt, args.decode_tokens, args.repeats)

    print(f"\n{len(tokens)} held-out tokens, window {args.window}, stride {stride}; "
          f"{args.bits}-bit group {args.group_size} for {', '.join(m for m in methods if m in INT4)}")
    print(f"{'method':<12} {'quantize s':>10} {'weights MB':>10} {'vs fp16':>8} {'ppl':>8} {'KL':>9} "
          f"{'eval':>6} {'decode tok/s':>12} {'vs fp32':>8}")
    base = tps["fp32"]
    for name, q, ratio, res, how in rows:
        mb = "-" if q is None else f"{q / 1e6:.1f}"
        qs = made.get(name)
        t = tps.get(name)
        print(f"{name:<12} {'-' if qs is None else f'{qs:.0f}':>10} {mb:>10} {ratio:>8.3f} "
              f"{res['perplexity']:>8.3f} {res.get('kl', 0.0):>9.5f} {how:>6} "
              f"{'-' if t is None else f'{t:.1f}':>12} {'-' if t is None else f'{t / base:.2f}x':>8}")
    kl = {name: res.get("kl") for name, _, _, res, _ in rows}
    if "rtn" in kl:
        for m in ("gptq", "awq"):
            if m in kl:
                print(f"{m}: KL {100 * (1 - kl[m] / kl['rtn']):.0f}% lower than rtn")


if __name__ == "__main__":
    main()
