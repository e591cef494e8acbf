"""Decode speed and cache bytes vs context: a pure SSM and a hybrid against softmax attention.

    python benchmarks/bench_long_context.py [--contexts 1024,4096,16384,32768] [--decode-tokens 32]
                                            [--models mamba2,minimax,llama] [--hidden 256] [--layers 4]
                                            [--threads 1] [--json OUT]

Builds tiny random models with transformers (fixed seed, offline, saved under ``--work-dir`` or a
temporary directory): a Mamba2 (every layer an SSD mixer with a fixed-size state), a MiniMax when
lmplug has the architecture (lightning attention, one softmax layer in ``--softmax-every``, as
MiniMax-Text-01 interleaves them; ``--models`` can add ``qwen3_next``, gated delta rule layers
interleaved the same way) and a Llama of the same hidden size and layer count. For each
context, every model gets the same prompt of that many random token ids and prefills it (timed
apart, one after the other); every (model, context) engine keeps its sequence, and then they all
decode ``--decode-tokens`` greedy tokens at batch 1, one engine step of each in turn, so a change
in machine load falls on every model and context alike (the ratios compare like with like).
ms/token is the median decode step (tok/s and the ratios come from it); the fastest step ("min
ms", closest to an idle machine's figure when neighbours share the CPUs) is printed beside it and
the mean is in the JSON. fp32 on CPU, ``kvcache: paged`` (prefix caching off: state layers refuse
it) with a pool of exactly the blocks the sequence needs, ``max_model_len`` = context + 1 + decode
tokens (the prefill's own token, then the timed ones).

Cache bytes per sequence at a context: K/V bytes per token (every softmax layer) x context + the
state bytes (every state layer, independent of the context). The table gives each model's figures
beside the Llama's at the same context, and then each model's last context against its first: the
pure SSM should stay flat (ms/token within 1.2x from 1k to 32k), the hybrid grows with its softmax
layers' share, the Llama with all of its layers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Mamba2Config,
    MiniMaxConfig,
    PretrainedConfig,
    Qwen3NextConfig,
)

from lmplug import LLM, RequestOutput, SamplingParams
from lmplug.plugins import get_registry

VOCAB = 1024
BLOCK_SIZE = 16


@dataclass
class Row:
    model: str
    context: int
    prefill_s: float
    decode_ms_median: float
    decode_ms_mean: float
    decode_ms_min: float
    kv_bytes_per_token: int
    state_bytes_per_seq: int

    @property
    def cache_bytes(self) -> int:
        return self.kv_bytes_per_token * self.context + self.state_bytes_per_seq

    @property
    def tok_s(self) -> float:
        return 1000.0 / self.decode_ms_median


def model_configs(a: argparse.Namespace) -> dict[str, PretrainedConfig]:
    """The ``--models`` lmplug can load, in that order. Same hidden size, layer count and vocabulary;
    the MoE hybrids' two active experts (plus Qwen3-Next's shared expert) are as wide as the Llama's
    MLP; Mamba2's inner width is 2 x hidden (its in/out projections stand in for an MLP)."""
    heads = a.hidden // a.head_dim
    common = {"vocab_size": VOCAB, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    attn = {"num_attention_heads": heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "max_position_embeddings": max(a.contexts) + 1 + a.decode_tokens}
    # hybrids: softmax at layers every-1, 2 * every-1, ... (MiniMax-Text-01: 1 in 8, Qwen3-Next: 1 in 4)
    layer_types = ["full_attention" if (i + 1) % a.softmax_every == 0 else "linear_attention"
                   for i in range(a.layers)]
    builders = {
        "mamba2": lambda: Mamba2Config(**common, num_heads=2 * a.hidden // a.head_dim, head_dim=a.head_dim,
                                       expand=2, state_size=a.state_size, n_groups=1, conv_kernel=4,
                                       chunk_size=256),
        "minimax": lambda: MiniMaxConfig(**common, **attn, intermediate_size=a.intermediate // 2,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         layer_types=layer_types, block_size=256),
        "qwen3_next": lambda: Qwen3NextConfig(**common, **attn, layer_types=layer_types,
                                              linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
                                              linear_key_head_dim=a.head_dim, linear_value_head_dim=a.head_dim,
                                              num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=a.intermediate // 4,
                                              shared_expert_intermediate_size=a.intermediate // 2),
        "llama": lambda: LlamaConfig(**common, **attn, intermediate_size=a.intermediate),
    }
    configs = {}
    served = {t for info in get_registry().backends("model").values() for t in info.cls.model_types}
    for name in a.models:
        if name not in builders:
            raise SystemExit(f"--models: {name!r} is not one of {', '.join(builders)}")
        if name in served:
            configs[name] = builders[name]()
        else:
            print(f"{name}: skipped (no installed architecture serves model_type {name!r})")
    return configs


def save_models(configs: dict[str, PretrainedConfig], work_dir: Path) -> dict[str, Path]:
    paths = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        path = work_dir / name
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
        paths[name] = path
    return paths


def open_llm(path: Path, context: int, a: argparse.Namespace) -> LLM:
    max_len = context + 1 + a.decode_tokens  # the prefill's token, then the decoded ones
    kvcache = {"backend": "paged", "block_size": BLOCK_SIZE, "prefix_caching": False,
               "num_blocks": math.ceil(max_len / BLOCK_SIZE) + 1}
    scheduler = {"backend": "continuous", "max_num_seqs": 1, "max_num_batched_tokens": a.prefill_chunk}
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=max_len, kvcache=kvcache,
               scheduler=scheduler)


def _num_tokens(outs: list[RequestOutput], request_id: str) -> int:
    """Tokens ``request_id`` has generated, per a step's outputs (0 when the step has none for it)."""
    return max((len(o.token_ids) for o in outs if o.request_id == request_id), default=0)


def prefill(llm: LLM, prompt: list[int], decode_tokens: int) -> float:
    """Warm the engine up on a short request, then add ``prompt`` and step until its first token
    (the prefill's last chunk samples it); returns the prefill's seconds."""
    engine = llm.engine
    engine.add_request("warm-up", list(range(3, 35)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1 + decode_tokens, ignore_eos=True))
    started = time.perf_counter()
    while not _num_tokens(engine.step(), "r"):
        pass
    return time.perf_counter() - started


def decode_interleaved(llms: dict[tuple[str, int], LLM], decode_tokens: int) -> dict[tuple[str, int], list[float]]:
    """One decode step of each (model, context) in turn until all have decoded ``decode_tokens``
    tokens, so a change in machine load falls on every one alike; returns each one's step seconds."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in llms}
    for _ in range(decode_tokens):
        for key, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.engine.step()
            times[key].append(time.perf_counter() - t0)
            if _num_tokens(outs, "r") != len(times[key]) + 1:
                raise RuntimeError(f"{key}: decode step {len(times[key])} did not add one token")
    for key, llm in llms.items():
        if llm.engine.has_unfinished_requests():
            raise RuntimeError(f"{key}: the request is still running after {decode_tokens} decode steps")
    return times


def backends_line(name: str, llm: LLM) -> str:
    chosen = llm.engine.resolved.backends
    return f"{name}: " + ", ".join(f"{section} {chosen[section].name}" for section in
                                   ("attention", "mixer", "moe", "kvcache") if section in chosen)


def measure(paths: dict[str, Path], a: argparse.Namespace) -> list[Row]:
    """Every model at every context: per context the same random prompt, prefilled by each model in
    turn (its engine then holds the sequence); then all decode steps interleaved, so the ratios
    across contexts, not only across models, see the same machine load."""
    llms: dict[tuple[str, int], LLM] = {}
    prefill_s: dict[tuple[str, int], float] = {}
    try:
        for i, context in enumerate(a.contexts):
            prompt = torch.randint(3, VOCAB, (context,), generator=torch.Generator().manual_seed(i)).tolist()
            for name, path in paths.items():
                llm = llms[name, context] = open_llm(path, context, a)
                if i == 0:
                    print(backends_line(name, llm))
                prefill_s[name, context] = prefill(llm, prompt, a.decode_tokens)
            print(f"  prefilled {context}: " + ", ".join(f"{name} {prefill_s[name, context]:.1f} s"
                                                         for name in paths), flush=True)
        times = decode_interleaved(llms, a.decode_tokens)
        return [Row(name, context, prefill_s[name, context], 1000 * statistics.median(times[name, context]),
                    1000 * statistics.fmean(times[name, context]), 1000 * min(times[name, context]),
                    llm.engine.kv.bytes_per_token, llm.engine.kv.spec.state_bytes_per_seq)
                for (name, context), llm in llms.items()]
    finally:
        for llm in llms.values():
            llm.close()


def print_table(rows: list[Row]) -> None:
    llama = {r.context: r for r in rows if r.model == "llama"}
    print(f"\n{'model':<11}{'context':>8}{'prefill s':>11}{'decode tok/s':>14}{'ms/token':>10}{'min ms':>8}"
          f"{'cache MiB/seq':>15}{'speed / llama':>15}{'bytes / llama':>15}")
    for r in rows:
        ref = llama.get(r.context)
        speed = f"{r.tok_s / ref.tok_s:.2f}x" if ref else "-"
        size = f"{r.cache_bytes / ref.cache_bytes:.3f}x" if ref else "-"
        print(f"{r.model:<11}{r.context:>8}{r.prefill_s:>11.2f}{r.tok_s:>14.1f}{r.decode_ms_median:>10.2f}"
              f"{r.decode_ms_min:>8.2f}"
              f"{r.cache_bytes / 2**20:>15.3f}{speed:>15}{size:>15}")
    first, last = min(r.context for r in rows), max(r.context for r in rows)
    print(f"\n{'model':<11}{f'ms/token {last} / {first}':>26}{'min ms':>10}{f'cache bytes {last} / {first}':>30}")
    for name in dict.fromkeys(r.model for r in rows):
        lo, hi = (next(r for r in rows if r.model == name and r.context == c) for c in (first, last))
        print(f"{name:<11}{hi.decode_ms_median / lo.decode_ms_median:>25.2f}x"
              f"{hi.decode_ms_min / lo.decode_ms_min:>9.2f}x"
              f"{hi.cache_bytes / lo.cache_bytes:>29.2f}x")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="1024,4096,16384,32768",
                   type=lambda s: sorted(int(x) for x in s.split(",")), help="prompt lengths, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens timed after the prefill")
    p.add_argument("--models", default="mamba2,minimax,llama", type=lambda s: s.split(","),
                   help="of mamba2, minimax, qwen3_next, llama (the reference of the ratios)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32, help="attention head size; Mamba2's head size too")
    p.add_argument("--kv-heads", type=int, default=4, help="K/V heads of the softmax layers")
    p.add_argument("--intermediate", type=int, default=512, help="the Llama's MLP width")
    p.add_argument("--state-size", type=int, default=64, help="Mamba2's SSM state size N")
    p.add_argument("--softmax-every", type=int, default=4, help="hybrids: one softmax layer in this many")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="scheduler max_num_batched_tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--work-dir", type=Path, help="where the models are saved (default: a temporary dir)")
    p.add_argument("--json", type=Path, help="write the rows here")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    print(f"load average before: {load_average()}; torch threads {a.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = a.work_dir or Path(tmp)
        paths = save_models(model_configs(a), work_dir)
        rows = measure(paths, a)
    print_table(rows)
    print(f"\nload average after: {load_average()}")
    if a.json:
        a.json.write_text(json.dumps([{**asdict(r), "cache_bytes": r.cache_bytes} for r in rows], indent=1))


if __name__ == "__main__":
    main()
