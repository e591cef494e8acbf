"""The transformers fallback against the native architecture, side by side in one run.

Random weights at the demo model's size (hidden 576, 30 layers, 9 heads / 3 KV heads, FFN 1536,
vocab 49152), Llama and Qwen3, fp32 on the CPU: prefill tok/s (prompts of PROMPT tokens, one
output token) and decode tok/s at batch 1 and 16 sequences. Both engines are built once and
measured in interleaved rounds (native, fallback, native, ...), so a load change on a shared
machine hits both alike; prints each round's ratio fallback / native and their median (goal:
>= 0.7). With one torch thread (``OMP_NUM_THREADS=1``) the rates are per second of the process's
CPU time, which other processes on a loaded machine do not inflate; else of wall time.
``--profile`` prints torch's profile of one fallback decode run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fallback.py [--layers 30] [--decode 16] \
        [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

DEMO = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
PROMPT = 128


def build(model_type: str, layers: int, root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": 64} if model_type == "qwen3" else {}
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=layers, **DEMO, **extra)
    torch.manual_seed(0)
    path = root / model_type
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def clock() -> float:
    """CPU seconds of this process with one torch thread (a shared machine's load does not count),
    else wall seconds."""
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def rates(llm, batch: int, decode: int) -> tuple[float, float]:
    from lmplug import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 49152, (PROMPT,), generator=g).tolist() for _ in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    start = clock()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    prefill = batch * PROMPT / (clock() - start)
    start = clock()
    llm.generate(prompts, SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True))
    total = clock() - start
    # decode time: the whole run less its prefill (measured above at the same batch)
    decode_s = max(total - batch * PROMPT / prefill, 1e-9)
    return prefill, batch * decode / decode_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="llama,qwen3")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from lmplug import LLM

    print(f"load average at start: {os.getloadavg()}, torch threads: {torch.get_num_threads()}, "
          f"clock: {'CPU' if torch.get_num_threads() == 1 else 'wall'} time")
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.models.split(","):
            path = build(model_type, args.layers, Path(tmp))
            llms = {impl: LLM(str(path), dtype="float32", device="cpu", max_model_len=512, model_impl=impl)
                    for impl in ("native", "transformers")}
            for batch in map(int, args.batches.split(",")):
                ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
                for r in range(args.rounds):
                    row = {impl: rates(llm, batch, args.decode) for impl, llm in llms.items()}
                    (np_, nd), (fp, fd) = row["native"], row["transformers"]
                    ratios["prefill"].append(fp / np_)
                    ratios["decode"].append(fd / nd)
                    print(f"{model_type:6} batch {batch:2} round {r}: prefill native {np_:8.1f} fallback "
                          f"{fp:8.1f} tok/s ({fp / np_:.2f}x); decode native {nd:7.1f} fallback {fd:7.1f} "
                          f"tok/s ({fd / nd:.2f}x); load {os.getloadavg()[0]:.1f}", flush=True)
                print(f"{model_type:6} batch {batch:2} median of {args.rounds}: prefill "
                      f"{statistics.median(ratios['prefill']):.2f}x, decode {statistics.median(ratios['decode']):.2f}x "
                      f"(decode range {min(ratios['decode']):.2f}-{max(ratios['decode']):.2f})", flush=True)
            del llms
            if args.profile:
                profile(path, args.decode)


def profile(path: Path, decode: int) -> None:
    from lmplug import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=512, model_impl="transformers")
    llm.generate([[5] * 8], SamplingParams(max_tokens=2, ignore_eos=True))
    with torch.profiler.profile() as prof:
        llm.generate([[5] * 8], SamplingParams(max_tokens=decode, ignore_eos=True))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
