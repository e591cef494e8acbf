"""The native Gemma 2/3, SmolLM3, OLMo 2, Granite, Phi-3 and GPT-OSS architectures against the transformers
fallback and against transformers itself, side by side in one run.

Random weights at the demo model's size (hidden 576, 30 layers, 9 heads / 3 KV heads, FFN 1536,
vocab 49152; Gemma with head_dim 64 and its soft-caps on), fp32 on the CPU: decode tok/s at
batch 1 and 16 sequences (prompts of PROMPT tokens; the decode time is a run's time less its
prefill, measured alone). transformers: ``generate`` with its KV cache, greedy. The engines of a
model are loaded side by side and run in turn, ``--repeat`` rounds, each one's best kept. Prints
native / fallback (goal at batch 1: >= 1.5x), the same with the native decode step off (the Python
layers) and native / transformers.

    .venv/bin/python benchmarks/bench_architectures.py [--layers 30] [--decode 16] [--families gemma2,phi3]
        [--repeat 3]

The native decode step (every layer in one C call) runs these float32 models where the products
run on one thread (``OMP_NUM_THREADS=1``: the kit's C product, ``lmplug.kit.native_dense``);
``LMPLUG_NATIVE_STEP=0`` compares the Python layers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

DEMO = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
FAMILIES = {
    "gemma2": {"head_dim": 64, "sliding_window": 64, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64},
    "gemma3_text": {"head_dim": 64, "sliding_window": 64, "query_pre_attn_scalar": 64},
    "smollm3": {},
    "olmo2": {},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                "logits_scaling": 2.0},
    "phi3": {},
    "llama": {},  # the control: the kit's own decoder
    # 8 experts of 384 (top 2), their biases, sinks and YaRN at transformers' defaults
    "gpt_oss": {"head_dim": 64, "sliding_window": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 384},
}
PROMPT = 64


def build(model_type: str, layers: int, root: Path) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, num_hidden_layers=layers, **{**DEMO, **FAMILIES[model_type]})
    torch.manual_seed(0)
    path = root / model_type
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return path, model


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, 49152, (PROMPT,), generator=g).tolist() for _ in range(batch)]


CLOCK = time.perf_counter  # --cpu-time: time.process_time


def ours(llm, batch: int, decode: int) -> float:
    from lmplug import SamplingParams

    ids = prompts(batch)
    start = CLOCK()
    llm.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    prefill = CLOCK() - start
    start = CLOCK()
    llm.generate(ids, SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True))
    return batch * decode / max(CLOCK() - start - prefill, 1e-9)


@torch.no_grad()
def theirs(model, batch: int, decode: int) -> float:
    ids = torch.tensor(prompts(batch))
    kw = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    start = CLOCK()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    prefill = CLOCK() - start
    start = CLOCK()
    model.generate(ids, max_new_tokens=decode + 1, min_new_tokens=decode + 1, **kw)
    return batch * decode / max(CLOCK() - start - prefill, 1e-9)


def engines(path: Path) -> dict:
    """The three engines of one model, loaded side by side and warmed up."""
    from lmplug import LLM, SamplingParams

    out = {}
    for key, impl, step in (("native", "native", "1"), ("layers", "native", "0"), ("transformers", "transformers", "1")):
        os.environ["LMPLUG_NATIVE_STEP"] = step  # "0": the native architecture's Python layers
        out[key] = LLM(str(path), dtype="float32", device="cpu", max_model_len=512, model_impl=impl)
        out[key].generate(prompts(1), SamplingParams(max_tokens=2, ignore_eos=True))
    os.environ.pop("LMPLUG_NATIVE_STEP")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--repeat", type=int, default=1, help="rounds of runs, the best of each kept")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the process's CPU time, not the wall clock: on a machine shared with other "
                             "work, what the run itself cost (one thread: OMP_NUM_THREADS=1)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    print(f"load average: {os.getloadavg()}, torch threads: {torch.get_num_threads()}, clock: {CLOCK.__name__}")
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.families.split(","):
            path, hf = build(model_type, args.layers, Path(tmp))
            llms = engines(path)
            theirs(hf, 1, 1)  # warm-up
            for batch in map(int, args.batches.split(",")):
                row = dict.fromkeys([*llms, "hf"], 0.0)
                for _ in range(args.repeat):  # round robin: a loaded machine's drift hits each alike
                    for key, llm in llms.items():
                        row[key] = max(row[key], ours(llm, batch, args.decode))
                    row["hf"] = max(row["hf"], theirs(hf, batch, args.decode))
                n, p, f, h = row["native"], row["layers"], row["transformers"], row["hf"]
                print(f"{model_type:12} batch {batch:2}: decode native {n:7.1f} (Python layers {p:7.1f})  fallback "
                      f"{f:7.1f}  transformers {h:7.1f} tok/s; native/fallback {n / f:.2f}x (Python layers "
                      f"{p / f:.2f}x), native/transformers {n / h:.2f}x", flush=True)
            del hf, llms


if __name__ == "__main__":
    main()
