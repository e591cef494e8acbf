"""Prefix caching: time to first token of a request whose long system prompt is already cached.

    python benchmarks/bench_prefix_cache.py [--model smollm2-135m-instruct] [--system-tokens 1000]

Two requests share a system prompt of ``--system-tokens`` tokens and differ
in a short user turn. With ``kvcache: {backend: paged, prefix_caching: true}``
the second request reuses every full cached block of the shared prefix and
computes only the rest. Prints both TTFTs, their ratio, and the prompt
tokens each request computed. Runs unchanged on CUDA (``--device cuda``).
"""

from __future__ import annotations

import argparse
import time

import torch

from lmplug import LLM, SamplingParams


def ttft(llm: LLM, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding the request to its first token (sampling syncs the device), and the
    prompt tokens computed."""
    engine = llm.engine
    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    computed = 0
    while engine.has_unfinished_requests():
        engine.step()
        computed += engine.last_stats["num_prefill_tokens"]
    return time.perf_counter() - started, computed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()

    llm = LLM(args.model, device=args.device, max_model_len=args.system_tokens + args.user_tokens + 64,
              kvcache={"backend": "paged", "block_size": args.block_size, "prefix_caching": True})
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, vocab, (args.system_tokens,), generator=g).tolist()
    users = [torch.randint(100, vocab, (args.user_tokens,), generator=g).tolist() for _ in range(2)]
    ttft(llm, "warm-up", torch.randint(100, vocab, (32,), generator=g).tolist())
    first, first_computed = ttft(llm, "first", system + users[0])
    second, second_computed = ttft(llm, "second", system + users[1])
    print(f"{args.model} on {llm.engine.resolved.device} ({llm.engine.resolved.dtype}), "
          f"attention {llm.engine.resolved.backends['attention'].name}, block_size {args.block_size}")
    print(f"shared system prompt {args.system_tokens} tokens + user turn {args.user_tokens} tokens")
    print(f"{'request':<10}{'TTFT ms':>10}{'tokens computed':>18}")
    print(f"{'first':<10}{first * 1000:>10.1f}{first_computed:>18}")
    print(f"{'second':<10}{second * 1000:>10.1f}{second_computed:>18}")
    print(f"second request's TTFT is {first / second:.1f}x lower")


if __name__ == "__main__":
    main()
