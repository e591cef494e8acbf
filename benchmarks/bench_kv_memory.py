"""KV memory: contiguous (a max_model_len row per sequence) vs paged (blocks as tokens arrive).

    python benchmarks/bench_kv_memory.py [--model smollm2-135m-instruct] [--kv-gb 1.0]
                                         [--requests 400] [--skip-model]
                                         [--kv-dtypes auto,int8,fp8_e4m3] [--quality-tokens 64]

On the demo model's KV shape (or a same-shape stand-in when it is not
cached), for one fixed KV budget:

1. capacity: how many requests of a realistic mixed-length workload (fixed
   seed) fit at once, at their final lengths;
2. a run of the whole workload, one token per running sequence per step:
   mean concurrent sequences, steps to finish, and utilization = KV bytes
   holding live tokens / KV bytes handed to sequences (averaged over steps).
   Admission: contiguous needs a free row; paged needs blocks for the prompt,
   and a sequence that cannot grow preempts the newest one (recomputed later),
   as a continuous-batching scheduler would;
3. ``n = 4`` sampling on the real model: KV blocks after the prompt and after
   the first token, against ``n = 1`` (the siblings fork the prompt's blocks);
4. KV quantization (kvcache ``dtype``): bytes/token, the tokens the paged pool
   holds in the same budget and the requests that fit, per ``--kv-dtypes``;
   then on the real model (paged, sdpa-equivalent ``paged`` attention, the
   model dtype) the prompt logprobs' max / mean abs difference against
   ``dtype: auto`` and the greedy tokens that agree over ``--quality-tokens``.

Parts 1–2 and the capacity of 4 use the real KV backends' accounting on the
``meta`` device (no memory, no model compute), so they take seconds; part 3
and the quality of 4 load the model.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
from lmplug_kvcache.contiguous import ContiguousKVCache, ContiguousOptions
from lmplug_kvcache.paged import PagedKVCache, PagedOptions

from lmplug.api import KVCacheSpec
from lmplug.errors import LmplugError
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence

DEMO_SHAPE = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # SmolLM2-135M


@dataclass
class Request:
    prompt_len: int
    output_len: int

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


def workload(num: int, max_model_len: int, seed: int) -> list[Request]:
    """Chat-like lengths: log-normal prompts (median 256), uniform outputs 16..512."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.exp(torch.randn(num, generator=g) * 0.8 + math.log(256)).clamp(16, 1536).long()
    outputs = torch.randint(16, 513, (num,), generator=g)
    return [Request(int(p), int(min(o, max_model_len - p))) for p, o in zip(prompts, outputs)]


def kv_shape(model: str) -> tuple[dict, str]:
    try:
        from lmplug.engine.architecture import model_config_of
        from lmplug.loading import open_source
        from lmplug.loading.cache import resolve_model

        cfg = model_config_of(open_source(resolve_model(model)).hf_config)
        return {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim}, model
    except (LmplugError, OSError) as exc:  # not cached: the same shape stands in
        return DEMO_SHAPE, f"SmolLM2-135M shape ({model} unavailable: {type(exc).__name__})"


def make_backends(shape: dict, args) -> tuple[ContiguousKVCache, PagedKVCache]:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    spec = KVCacheSpec(**shape, dtype=dtype, device=torch.device("meta"),
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    budget_tokens = int(args.kv_gb * 2**30) // spec.bytes_per_token
    rows = budget_tokens // args.max_model_len
    contiguous = ContiguousKVCache(ContiguousOptions(max_num_seqs=max(rows, 1)), spec)
    paged = PagedKVCache(PagedOptions(block_size=args.block_size,
                                      num_blocks=budget_tokens // args.block_size), spec)
    return contiguous, paged


def new_seq(i: int, req: Request) -> Sequence:
    return Sequence(str(i), [1] * req.prompt_len, SamplingParams(max_tokens=req.output_len))


def capacity(kv, requests: list[Request]) -> int:
    """Requests that fit together at their final lengths, admitted in order."""
    held = []
    for i, req in enumerate(requests):
        seq = new_seq(i, req)
        seq.token_ids += [1] * req.output_len
        if not kv.can_allocate(seq, req.final_len):
            break
        kv.allocate(seq, req.final_len)
        held.append(seq)
    for seq in held:
        kv.free(seq)
    return len(held)


@dataclass
class RunStats:
    mean_running: float
    steps: int
    utilization: float  # live token bytes / bytes handed to sequences
    preemptions: int


def allocated_tokens(kv, running: list[Sequence]) -> int:
    if isinstance(kv, PagedKVCache):
        return kv.blocks.num_used_blocks * kv.block_size
    return len(running) * kv.spec.max_model_len


def preempt(kv, seq: Sequence, waiting: deque) -> None:
    """Free a sequence and queue it first again; on re-admission its tokens so far are recomputed."""
    kv.free(seq)
    seq.num_computed_tokens = 0
    waiting.appendleft(seq)


def run(kv, requests: list[Request], max_num_seqs: int) -> RunStats:
    waiting = deque(new_seq(i, r) for i, r in enumerate(requests))
    running: list[Sequence] = []
    steps, preemptions, concurrency, utilization = 0, 0, [], []
    while waiting or running:
        while (waiting and len(running) < max_num_seqs
               and kv.can_allocate(waiting[0], waiting[0].num_tokens + 1)):
            seq = waiting.popleft()
            kv.allocate(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens
            running.append(seq)
        for seq in running.copy():  # one decode token each; grow, preempting the newest if needed
            if seq not in running:
                continue
            while not kv.can_allocate(seq, seq.num_tokens + 1):
                victim = running.pop()
                preempt(kv, victim, waiting)
                preemptions += 1
                if victim is seq:
                    break
            else:
                seq.token_ids.append(1)
                kv.allocate(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
        steps += 1
        concurrency.append(len(running))
        utilization.append(sum(s.num_tokens for s in running) / max(allocated_tokens(kv, running), 1))
        for seq in [s for s in running if s.num_output_tokens >= s.params.max_tokens]:
            running.remove(seq)
            kv.free(seq)
    return RunStats(statistics.mean(concurrency), steps, statistics.mean(utilization), preemptions)


def n_sampling_blocks(model: str, block_size: int, prompt_len: int) -> dict[int, tuple[int, int]]:
    """Used KV blocks after the prompt step and after the first decode step, for n = 1 and n = 4."""
    from lmplug import LLM

    llm = LLM(model, device="cpu", dtype="float32", max_model_len=2048,
              kvcache={"backend": "paged", "block_size": block_size, "num_blocks": 256})
    prompt = torch.randint(100, 20000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    used = {}
    for n in (1, 4):
        engine = llm.engine
        engine.add_request(f"n{n}", prompt, SamplingParams(n=n, temperature=1.0, max_tokens=4, seed=0))
        engine.step()
        after_prompt = engine.kv.blocks.num_used_blocks
        engine.step()
        used[n] = (after_prompt, engine.kv.blocks.num_used_blocks)
        while engine.has_unfinished_requests():
            engine.step()
    return used


QUALITY_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "Write a short Python function that returns the n-th Fibonacci number.\n",
    "Q: Why is the sky blue during the day and red at sunset?\nA:",
    "In a small village at the foot of the mountains there lived an old clockmaker who",
]


def kv_dtype_capacity(shape: dict, args, kv_dtypes: list[str], requests: list[Request]) -> None:
    """Tokens and requests the paged pool holds in ``--kv-gb`` for each kvcache dtype."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    spec = KVCacheSpec(**shape, dtype=dtype, device=torch.device("meta"),
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    print(f"\nKV dtype ({args.dtype} model, paged, memory_gb={args.kv_gb}, block_size {args.block_size}):")
    print(f"{'dtype':<10}{'bytes/token':>12}{'pool tokens':>13}{'vs auto':>9}{'fit at once':>13}")
    base = None
    for kv_dtype in kv_dtypes:
        kv = PagedKVCache(PagedOptions(block_size=args.block_size, memory_gb=args.kv_gb, dtype=kv_dtype), spec)
        base = base or kv.num_tokens
        print(f"{kv_dtype:<10}{kv.bytes_per_token:>12}{kv.num_tokens:>13}{kv.num_tokens / base:>8.2f}x"
              f"{capacity(kv, requests):>13}")


def kv_dtype_quality(model: str, args, kv_dtypes: list[str]) -> None:
    """Prompt logprobs and greedy tokens of each quantized KV dtype against ``dtype: auto``."""
    from lmplug import LLM

    params = SamplingParams(temperature=0, max_tokens=args.quality_tokens, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for kv_dtype in ["auto", *[d for d in kv_dtypes if d != "auto"]]:
        llm = LLM(model, device="cpu", dtype=args.dtype, max_model_len=args.max_model_len,
                  attention="paged", kvcache={"backend": "paged", "block_size": args.block_size,
                                              "num_blocks": 256, "dtype": kv_dtype})
        outs = llm.generate(QUALITY_PROMPTS, params)
        lps = torch.tensor([lp[t].logprob for o in outs
                            for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
        results[kv_dtype] = (lps, [o.outputs[0].token_ids for o in outs])
    base_lps, base_tokens = results.pop("auto")
    print(f"\nKV dtype quality vs dtype: auto ({args.dtype} model, {len(QUALITY_PROMPTS)} prompts, "
          f"{len(base_lps)} prompt positions, {args.quality_tokens} greedy tokens each):")
    print(f"{'dtype':<10}{'logprob |diff| max':>20}{'mean':>10}{'greedy equal':>14}{'same prefix':>13}")
    for kv_dtype, (lps, tokens) in results.items():
        diff = (lps - base_lps).abs()
        pairs = list(zip(tokens, base_tokens))
        equal = sum(a == b for x, y in pairs for a, b in zip(x, y))
        prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in pairs)
        total = sum(map(len, tokens))
        print(f"{kv_dtype:<10}{diff.max():>20.4f}{diff.mean():>10.4f}{equal:>9}/{total:<4}{prefix:>8}/{total}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--kv-gb", type=float, default=1.0, help="the KV budget both caches get (GiB)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256, help="scheduler cap (set high: memory binds)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=200, help="prompt of the n = 4 measurement")
    p.add_argument("--skip-model", action="store_true", help="accounting only; do not load the model")
    p.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3", help="kvcache dtypes to compare (part 4)")
    p.add_argument("--quality-tokens", type=int, default=64, help="greedy tokens per prompt (part 4)")
    args = p.parse_args()
    kv_dtypes = args.kv_dtypes.split(",")

    started = time.perf_counter()
    shape, source = kv_shape(args.model)
    contiguous, paged = make_backends(shape, args)
    requests = workload(args.requests, args.max_model_len, args.seed)
    lens = [r.final_len for r in requests]
    print(f"KV shape: {source}, {args.dtype}: {paged.bytes_per_token} bytes/token; budget {args.kv_gb} GiB "
          f"= {paged.num_tokens} tokens; max_model_len {args.max_model_len}; block_size {args.block_size}")
    print(f"workload: {len(requests)} requests, seed {args.seed}, final length mean "
          f"{statistics.mean(lens):.0f}, median {statistics.median(lens):.0f}, max {max(lens)}\n")
    backends = {"contiguous": contiguous, "paged": paged}
    fit = {name: capacity(kv, requests) for name, kv in backends.items()}
    stats = {name: run(kv, requests, args.max_num_seqs) for name, kv in backends.items()}
    print(f"{'KV cache':<12}{'fit at once':>12}{'mean running':>14}{'steps':>8}{'utilization':>13}"
          f"{'preempted':>11}")
    for name, s in stats.items():
        print(f"{name:<12}{fit[name]:>12}{s.mean_running:>14.1f}{s.steps:>8}{s.utilization:>12.1%}"
              f"{s.preemptions:>11}")
    print(f"paged / contiguous: {fit['paged'] / fit['contiguous']:.2f}x requests fit, "
          f"{stats['paged'].mean_running / stats['contiguous'].mean_running:.2f}x mean running, "
          f"{stats['contiguous'].steps / stats['paged'].steps:.2f}x fewer steps")
    if not args.skip_model:
        used = n_sampling_blocks(args.model, args.block_size, args.prompt_len)
        print(f"\nn = 4 sampling, {args.prompt_len}-token prompt (KV blocks in use; n = 4 without sharing "
              f"would hold 4x n = 1):")
        for n, (after_prompt, after_first) in used.items():
            print(f"  n = {n}: {after_prompt} after the prompt, {after_first} after the first token")
        print(f"  n = 4 / n = 1: {used[4][0] / used[1][0]:.2f}x after the prompt, "
              f"{used[4][1] / used[1][1]:.2f}x after the first token")
    kv_dtype_capacity(shape, args, kv_dtypes, requests)
    if not args.skip_model and len(kv_dtypes) > 1:
        kv_dtype_quality(args.model, args, kv_dtypes)
    print(f"\n({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
