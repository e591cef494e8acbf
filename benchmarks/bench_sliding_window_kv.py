"""KV memory of a sliding-window model as the sequence grows past the window.

    python benchmarks/bench_sliding_window_kv.py [--window 64] [--tokens 512]

Builds a small random Mistral (transformers, fixed seed) with the given
window, generates greedily with the paged KV cache, and prints the KV bytes
the sequence holds at several lengths next to what the contiguous cache
reserves (max_model_len per sequence).
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, MistralConfig

from lmplug import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                        sliding_window=a.window, max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        max_len = a.tokens + 64
        llm = LLM(tmp, max_model_len=max_len, attention="paged", scheduler="continuous",
                  kvcache={"backend": "paged", "block_size": a.block_size, "num_blocks": 256})
        engine = llm.engine
        block_bytes = engine.kv.bytes_per_token * a.block_size
        engine.add_request("r", list(range(3, 35)), SamplingParams(temperature=0, max_tokens=a.tokens - 32,
                                                                   ignore_eos=True))
        marks = {m for m in (a.window // 2, a.window, 2 * a.window, 4 * a.window, a.tokens - 1) if m < a.tokens}
        print(f"window {a.window}, block {a.block_size} tokens, {engine.kv.bytes_per_token} bytes/token")
        print(f"{'tokens':>8}{'paged KV held (KiB)':>22}{'contiguous reserves (KiB)':>28}")
        n = 32
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
            if n in marks:
                held = engine.kv.blocks.num_used_blocks * block_bytes
                print(f"{n:>8}{held / 1024:>22.1f}{max_len * engine.kv.bytes_per_token / 1024:>28.1f}")


if __name__ == "__main__":
    main()
