"""CPU paths of the quant methods side by side: one linear layer, then batch-1 decode of a model.

    OMP_NUM_THREADS=1 python benchmarks/bench_quant_cpu.py [--in 2048] [--out 5632] [--model PATH|NAME]
        [--decode-tokens 48] [--skip-model]

Layer table: milliseconds per call of ``apply`` for M tokens, each row built through the quant
method's own ``create_weights`` / ``process_weights_after_loading`` (the engine's code path),
and the ratio to a dense float32 ``F.linear``: weight-only int4/int8 through torch's packed CPU
matmuls (bf16, ``dequantize_at_load: false``) vs dense bf16 and per-call unpacking, and W8A8
(int8 through ``torch._int_mm``, fp8 through its cached float32 weight; activations quantized on
every call). Model table: decode tokens/s at batch 1 (greedy, after the first token, median of
3) through ``LLM`` for the same choices on the demo model (quantized at load from its float
weights), relative to float32. Timings vary with the machine's load; compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

LAYER_CASES = {  # name -> (method name, options, model dtype)
    "dense bf16": (None, {}, torch.bfloat16),
    "rtn int4 g32 bf16 torch_packed": ("rtn", {"bits": 4, "group_size": 32, "dequantize_at_load": False},
                                       torch.bfloat16),
    "rtn int8 per-row bf16 int8pack": ("rtn", {"bits": 8, "group_size": -1, "dequantize_at_load": False},
                                       torch.bfloat16),
    "rtn int4 g32 fp32 per-call unpack": ("rtn", {"bits": 4, "group_size": 32, "dequantize_at_load": False},
                                          torch.float32),
    "int8 W8A8 fp32 (_int_mm)": ("int8", {}, torch.float32),
    "fp8 W8A8 fp32 (cached fp32 weight)": ("fp8", {}, torch.float32),
    "fp8 W8A8 fp32 (per-call reference)": ("fp8", {"dequantize_at_load": False}, torch.float32),
}

MODEL_CASES = {  # name -> (LLM keywords)
    "float32 dense": {"dtype": "float32"},
    "bfloat16 dense": {"dtype": "bfloat16"},
    "rtn int4 g32 bf16 torch_packed": {"dtype": "bfloat16", "quant": {
        "method": "rtn", "bits": 4, "group_size": 32, "dequantize_at_load": False}},
    "int8 W8A8 fp32 (_int_mm)": {"dtype": "float32", "quant": {"method": "int8"}},
    "fp8 W8A8 fp32": {"dtype": "float32", "quant": {"method": "fp8"}},
}


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def make_layer(method_name, options, dtype, weight):
    from lmplug.plugins import get_registry

    layer = torch.nn.Module()
    layer.in_features, layer.out_features = weight.shape[1], weight.shape[0]
    if method_name is None:
        layer.weight = weight.to(dtype)
        return lambda x: F.linear(x, layer.weight)
    cls = get_registry().get("quant", method_name).cls
    method = cls(cls.Options(**options))
    method.create_weights(layer, weight.shape[1], weight.shape[0], dtype, bias=False)
    layer.weight.data.copy_(weight)
    method.process_weights_after_loading(layer)
    return lambda x: method.apply(layer, x)


def layer_table(n_in: int, n_out: int) -> None:
    weight = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(0)) * 0.02
    tokens = (1, 4, 16, 64)
    base = {m: timed(lambda m=m: F.linear(torch.randn(m, n_in), weight), 20) for m in tokens}
    print(f"\nlayer {n_in} -> {n_out}, ms per call (x dense float32), {torch.get_num_threads()} thread(s)")
    print(f"{'path':40s}" + "".join(f"{'M=' + str(m):>18s}" for m in tokens))
    print(f"{'dense float32':40s}" + "".join(f"{base[m]:11.3f} (1.00)" for m in tokens))
    for name, (method, options, dtype) in LAYER_CASES.items():
        run = make_layer(method, options, dtype, weight)
        cells = []
        for m in tokens:
            x = torch.randn(m, n_in).to(dtype)
            t = timed(lambda x=x, run=run: run(x), 20 if "unpack" not in name and "per-call" not in name else 3)
            cells.append(f"{t:11.3f} ({base[m] / t:4.2f})")
        print(f"{name:40s}" + "".join(cells))


def model_table(model: str, decode_tokens: int) -> None:
    from lmplug import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)
    prompt = list(range(100, 132))
    rates = {}
    for name, kwargs in MODEL_CASES.items():
        llm = LLM(model, device="cpu", max_model_len=256, **kwargs)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([prompt], one)  # warm-up
        # the prompt's prefill and first token are in every run; subtract them, measured alone
        prefill = timed(lambda llm=llm, one=one: llm.generate([prompt], one), 3) / 1e3
        whole = timed(lambda llm=llm: llm.generate([prompt], params), 3) / 1e3
        rates[name] = decode_tokens / max(whole - prefill, 1e-9)
        del llm
    base = rates["float32 dense"]
    print(f"\n{model}: decode tokens/s at batch 1 ({decode_tokens} tokens, {torch.get_num_threads()} thread(s))")
    for name, rate in rates.items():
        print(f"{name:40s}{rate:9.1f}  ({rate / base:4.2f}x float32)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--in", dest="n_in", type=int, default=2048)
    parser.add_argument("--out", dest="n_out", type=int, default=5632)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()
    layer_table(args.n_in, args.n_out)
    if not args.skip_model:
        model_table(args.model, args.decode_tokens)


if __name__ == "__main__":
    main()
