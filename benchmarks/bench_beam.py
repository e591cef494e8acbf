"""Beam search side by side with transformers' ``generate(num_beams=...)``, one run, ratios.

    python benchmarks/bench_beam.py [--widths 1 4 8] [--prompt-len 64] [--max-tokens 32] [--threads 1]

The demo model (SmolLM2-135M) dequantised from its GGUF to a dense fp32 checkpoint by transformers'
GGUF reader, so both engines run the same weights in fp32 on the CPU. Per width: wall time of the
whole search (prompt included, no EOS: every beam runs ``--max-tokens``), beam tokens/s (width x new
tokens / time), and the KV held at the peak: lmplug's paged blocks (block size 16, sampled each
step) against the blocks ``width`` separate copies need, which is what transformers' cache holds
(one row per beam, the prompt repeated). Runs interleave (lmplug, transformers, per width), after
one warm-up each. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from lmplug import LLM, SamplingParams

BLOCK = 16


def dense_demo(folder: Path):
    """The demo GGUF as a dense fp32 HF model saved under ``folder``."""
    from transformers import AutoModelForCausalLM

    from lmplug.loading.cache import pull

    gguf = pull("smollm2-135m-instruct")
    read = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = read.config
    del config.quantization_config  # dense now; a "gguf" model will not save
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(read.state_dict())
    hf.eval().save_pretrained(folder)
    return hf


def run_lmplug(llm: LLM, ids: list[int], width: int, max_new: int) -> tuple[float, int]:
    engine = llm.engine
    engine.add_request(f"w{width}-{time.perf_counter()}", ids,
                       SamplingParams(n=1, beam_width=width, max_tokens=max_new, ignore_eos=True))
    start, peak = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.blocks.num_used_blocks)
    return time.perf_counter() - start, peak


@torch.no_grad()
def run_hf(hf, ids: list[int], width: int, max_new: int) -> float:
    start = time.perf_counter()
    hf.generate(torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new, num_beams=width,
                do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        hf = dense_demo(Path(tmp))
        llm = LLM(tmp, dtype="float32", device="cpu", max_model_len=args.prompt_len + args.max_tokens + 8,
                  kvcache={"backend": "paged", "block_size": BLOCK, "num_blocks": 512, "prefix_caching": False})
        ids = [(i * 37) % 4000 + 100 for i in range(args.prompt_len)]
        run_lmplug(llm, ids, 2, 4), run_hf(hf, ids, 2, 4)  # warm-up
        print(f"prompt {args.prompt_len} tokens, {args.max_tokens} new, fp32, {args.threads} thread(s)")
        print("width | lmplug s | hf s | speed-up | lmplug beam tok/s | lmplug peak blocks | copies' blocks")
        for width in args.widths:
            t_ours, peak = run_lmplug(llm, ids, width, args.max_tokens)
            t_hf = run_hf(hf, ids, width, args.max_tokens)
            copies = width * -(-(args.prompt_len + args.max_tokens) // BLOCK)
            print(f"{width:5d} | {t_ours:8.2f} | {t_hf:4.2f} | {t_hf / t_ours:7.2f}x | "
                  f"{width * args.max_tokens / t_ours:17.1f} | {peak:18d} | {copies:14d}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
