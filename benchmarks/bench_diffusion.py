"""Block diffusion (DiffusionGemma's denoising select stage) against autoregressive decoding of
the same Gemma 4 MoE backbone, side by side in one run.

Tiny random weights (hidden 256, 4 layers, 8 experts, vocab 4096; fp32, CPU), one request of
PROMPT prompt tokens and NEW new tokens. Diffusion: each canvas of ``C`` tokens is denoised for
up to ``S`` steps (random weights never satisfy the early stop, so every canvas takes its ``S``
steps: the run shows the cost of the step budget, not a trained model's early exits), then one
encoder pass writes it. Autoregressive: the ``gemma4_text`` architecture with the same shapes,
greedy, one forward per token. Prints per configuration: tokens per decoder forward (the
committed tokens over denoising steps, transformers' ``tokens_per_forward``), forwards in all
(denoising steps + encoder passes, against one per token), and tok/s, with the ratio to
autoregressive decoding.

    .venv/bin/python benchmarks/bench_diffusion.py [--canvas 4,8,16,32] [--steps 4,16,48] [--new 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

PROMPT = 32
TEXT = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "global_head_dim": 128,
        "num_global_key_value_heads": 1, "sliding_window": 128, "num_experts": 8, "top_k_experts": 2,
        "moe_intermediate_size": 128, "max_position_embeddings": 1024, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}


def build_diffusion(root: Path, canvas: int) -> Path:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=TEXT, vision_config=vision,
                                                                 canvas_length=canvas))
    path = root / f"diffusion-{canvas}"
    model.save_pretrained(path)
    return path


def build_autoregressive(root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma4_text", **TEXT, enable_moe_block=True, attention_k_eq_v=True,
                               hidden_size_per_layer_input=0)
    torch.manual_seed(0)
    path = root / "autoregressive"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def run(path: Path, params, warm: bool = True) -> tuple[float, dict, int]:
    from lmplug import LLM

    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=PROMPT + 512,
              kvcache={"backend": "paged", "block_size": 16})
    prompt = torch.randint(3, TEXT["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    if warm:
        llm.generate([prompt], params)
    started = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - started, dict(llm.engine.last_stats), len(out.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--canvas", default="4,8,16,32")
    parser.add_argument("--steps", default="4,16,48")
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    from lmplug import SamplingParams

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="lmplug-bench-diffusion-"))
    ar_time, _, ar_tokens = run(build_autoregressive(root),
                                SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True))
    ar_rate = ar_tokens / ar_time
    print(f"autoregressive: {ar_tokens} tokens, {ar_tokens} forwards, {ar_rate:.1f} tok/s")
    print(f"{'canvas':>6} {'steps':>5} {'tok/decoder fwd':>15} {'forwards':>8} {'tok/s':>8} {'vs AR':>6}")
    for canvas in map(int, args.canvas.split(",")):
        path = build_diffusion(root, canvas)
        for steps in map(int, args.steps.split(",")):
            params = SamplingParams(max_tokens=args.new, denoising={"max_denoising_steps": steps})
            took, _, tokens = run(path, params)
            canvases = -(-tokens // canvas)
            denoising = canvases * steps  # random weights: no early stop
            forwards = denoising + canvases  # + one encoder pass per committed canvas
            rate = tokens / took
            print(f"{canvas:>6} {steps:>5} {tokens / denoising:>15.2f} {forwards:>8} {rate:>8.1f} "
                  f"{rate / ar_rate:>5.2f}x")


if __name__ == "__main__":
    main()
