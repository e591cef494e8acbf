"""``lmplug bench``: batch-1 decode speed, TTFT and load time, optionally beside HF transformers.

Both engines run in this one process on the same prompt token ids, greedy,
alternating repeats, so a noisy shared machine affects both alike; the
report gives medians and the lmplug / transformers ratio. The memory floor
is the weight bytes read per decode token divided by the measured copy
bandwidth of this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Run:
    load_s: float | None  # None: not measured (transformers on a GGUF file's dense weights)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tokens: list[int] | None = None
    metrics: object | None = None  # the last request's RequestMetrics (speculative statistics)

    @property
    def decode_tps(self) -> float:
        return 1.0 / statistics.median(self.tpot_s)

    @property
    def ttft_ms(self) -> float:
        return 1000 * statistics.median(self.ttft_s)


def copy_bandwidth_gbs(size_mb: int = 256, repeats: int = 5) -> float:
    """Bytes moved (read + write) per second by a large tensor copy."""
    src = torch.ones(size_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every matrix once, one embedding row."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight":
            tied = getattr(model, "lm_head", None) is None
            total += p.numel() * p.element_size() if tied else p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def _prompt_ids(vocab: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()


def bench_lmplug(overrides: dict, args: argparse.Namespace) -> tuple[Run, object]:
    from lmplug.llm import LLM

    started = time.perf_counter()
    llm = LLM(config=args.config, **overrides)
    run = Run(load_s=time.perf_counter() - started)
    return run, llm


def time_lmplug(llm, run: Run, prompt: list[int], args: argparse.Namespace) -> None:
    from lmplug.interfaces.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    stamps = []
    tokens: list[int] = []
    for out in llm.stream(prompt, params):
        stamps.extend([time.perf_counter()] * len(out.delta_token_ids))
        tokens = out.token_ids
        run.metrics = out.metrics
    run.ttft_s.append(stamps[0] - t0)
    run.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    run.tokens = tokens


def dense_hf_from_gguf(path, dtype: torch.dtype):
    """transformers' model for a GGUF file with dense ``dtype`` weights: the values lmplug runs.
    (transformers' own GGUF loading keeps quantized weights packed and computes in float32, which
    would compare a different computation.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmplug.loading import open_source

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: tensor.to(dtype) for name, tensor in open_source(path).iter_tensors()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"{path}: tensors do not match transformers' model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def bench_hf(path, args: argparse.Namespace) -> tuple[Run, object]:
    from transformers import AutoModelForCausalLM

    if str(path).endswith(".gguf"):  # its load time would be lmplug's reader: not reported
        return Run(load_s=None), dense_hf_from_gguf(path, torch.float32)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return Run(load_s=time.perf_counter() - started), model


def time_hf(model, run: Run, prompt: list[int], args: argparse.Namespace) -> None:
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.calls = 0

        def put(self, value) -> None:
            self.calls += 1
            if self.calls > 1:  # the first call carries the prompt
                self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    streamer = Stamps()
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             streamer=streamer, pad_token_id=0)
    run.ttft_s.append(streamer.times[0] - t0)
    run.tpot_s.append((streamer.times[-1] - streamer.times[0]) / (len(streamer.times) - 1))
    run.tokens = out[0, len(prompt):].tolist()


def run_bench(args: argparse.Namespace, overrides: dict) -> int:
    from lmplug.loading.cache import resolve_model

    if args.num_requests:
        return run_throughput(args, overrides)
    run, llm = bench_lmplug(overrides, args)
    engine = llm.engine
    prompt = _prompt_ids(engine.model_config.vocab_size, args.prompt_tokens)
    hf_run = hf_model = None
    if args.compare_hf:
        hf_run, hf_model = bench_hf(resolve_model(engine.config.model), args)
    for _ in range(args.repeats):
        time_lmplug(llm, run, prompt, args)
        if hf_model is not None:
            time_hf(hf_model, hf_run, prompt, args)
    bw = copy_bandwidth_gbs()
    wbytes = weight_bytes_per_token(engine.parts.model)
    counts = getattr(engine.parts.model, "parameter_counts", lambda: None)()  # MoE: (total, active)
    if counts is not None:  # a batch-1 decode token reads only its top-k experts
        wbytes -= (counts[0] - counts[1]) * next(engine.parts.model.parameters()).element_size()
    floor_s = wbytes / (bw * 1e9)
    print(f"model {engine.config.model} | dtype {engine.resolved.dtype} | threads {torch.get_num_threads()} | "
          f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new, {args.repeats} repeats (medians)")
    print("backends: " + ", ".join(f"{k}={v.name}" for k, v in engine.resolved.backends.items()))
    print_parallel(engine)
    print(f"{'engine':<14}{'load s':>9}{'TTFT ms':>10}{'decode tok/s':>14}{'% of floor':>12}")
    rows = [("lmplug", run)] + ([("transformers", hf_run)] if hf_run else [])
    for name, r in rows:
        load = "n/a" if r.load_s is None else f"{r.load_s:.2f}"
        print(f"{name:<14}{load:>9}{r.ttft_ms:>10.1f}{r.decode_tps:>14.2f}"
              f"{100 * floor_s * r.decode_tps:>11.1f}%")
    if counts is not None:
        print(f"parameters: {counts[0] / 1e6:,.2f} M total, {counts[1] / 1e6:,.2f} M active per token (MoE)")
    print(f"memory floor: {wbytes / 1e6:.0f} MB of weights per token / {bw:.1f} GB/s copy bandwidth = "
          f"{floor_s * 1000:.1f} ms/token ({1 / floor_s:.1f} tok/s)")
    print_speculative(engine)
    if engine.speculator is not None and run.metrics is not None:
        print(f"per request (last repeat): {run.metrics.spec_summary(len(run.tokens))}")
    if hf_run:
        same = run.tokens == hf_run.tokens
        load = "" if hf_run.load_s is None else f", load {hf_run.load_s / run.load_s:.1f}x faster"
        print(f"lmplug / transformers: decode {run.decode_tps / hf_run.decode_tps:.2f}x, "
              f"TTFT {hf_run.ttft_ms / run.ttft_ms:.2f}x faster{load}; greedy tokens identical: {same}")
    return 0


# -- many requests at once: throughput and per-step engine statistics ----------------------------


def workload(vocab: int, num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Requests of mixed prompt and output lengths (prompt ids, max_tokens), like a chat service."""
    import random

    rng = random.Random(seed)
    return [([rng.randrange(100, min(vocab, 30000)) for _ in range(rng.randint(16, 256))], rng.choice([8, 16, 32, 128]))
            for _ in range(num_requests)]


def run_throughput(args: argparse.Namespace, overrides: dict) -> int:
    from lmplug.interfaces.params import SamplingParams
    from lmplug.llm import LLM

    llm = LLM(config=args.config, **overrides)
    engine = llm.engine
    requests = workload(engine.model_config.vocab_size, args.num_requests)
    for i, (ids, max_tokens) in enumerate(requests):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    steps, generated, started = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        generated += sum(len(o.delta_token_ids) for o in outs)
        steps.append(dict(engine.last_stats))
    elapsed = time.perf_counter() - started
    print_throughput(engine, requests, steps, generated, elapsed)
    return 0


def print_parallel(engine) -> None:
    """Tensor parallelism: weight bytes and KV bytes per token held by each rank."""
    mem = engine.memory
    if mem and mem["tensor_parallel_size"] > 1:
        print(f"tensor parallel {mem['tensor_parallel_size']}: weights per rank "
              f"{', '.join(f'{b / 1e6:.1f}' for b in mem['weight_bytes_per_rank'])} MB; KV per rank "
              f"{', '.join(str(b) for b in mem['kv_bytes_per_token_per_rank'])} bytes/token")


def print_throughput(engine, requests, steps: list[dict], generated: int, elapsed: float) -> None:
    mean = lambda key: statistics.mean(s[key] for s in steps)
    prompt_tokens = sum(len(ids) for ids, _ in requests)
    print("backends: " + ", ".join(f"{k}={v.name}" for k, v in engine.resolved.backends.items()))
    print_parallel(engine)
    print(f"{len(requests)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.1f} s: "
          f"{generated / elapsed:.1f} generated tokens/s, {(prompt_tokens + generated) / elapsed:.1f} total tokens/s")
    print(f"{len(steps)} steps: running {mean('num_running'):.1f}, waiting {mean('num_waiting'):.1f}, "
          f"prefill tokens {mean('num_prefill_tokens'):.1f}, decode tokens {mean('num_decode_tokens'):.1f}, "
          f"KV use {100 * mean('kv_usage'):.0f}% (mean per step); peak KV use "
          f"{100 * max(s['kv_usage'] for s in steps):.0f}%")
    print_speculative(engine)


def print_speculative(engine) -> None:
    """Acceptance over the whole run, when a drafter is configured."""
    spec = engine.speculator
    if spec is None:
        return
    rate = spec.num_accepted / spec.num_drafted if spec.num_drafted else 0.0
    mean = spec.num_accepted / spec.num_verified if spec.num_verified else 0.0
    print(f"speculative {engine.resolved.backends['speculative'].name} (k={spec.num_tokens}): "
          f"{spec.num_drafted} drafted, {spec.num_accepted} accepted ({100 * rate:.0f}%), "
          f"{mean:.2f} accepted + 1 per verification")
