"""Many LoRA adapters at once: decode throughput at 16 concurrent requests spread over 1, 4 and 16
adapters, against the base model alone and against one merged engine per adapter.

    python benchmarks/bench_lora.py [--model dense|demo] [--layers 30] [--rank 8] [--requests 16]
                                    [--tokens 32] [--threads 2] [--adapter-dtype float32|float16|bfloat16]
                                    [--clock wall|cpu] [--rate batch|step] [--repeats 3]

``--model dense`` (default): a random Llama in SmolLM2-135M's shape (hidden 576, 9 heads over 3
KV heads, MLP 1536; ``--layers`` of them), float32 on the CPU, saved as an HF folder (the Python
layers). ``--model demo``: the demo model's packed GGUF (``lmplug models pull
smollm2-135m-instruct``) in the default config (packed blocks, the native decode step: with LoRA,
the adapter plugin's C product around each layer's). Each adapter a random PEFT adapter of rank
``--rank`` on every attention and MLP projection, its file's weights in ``--adapter-dtype``
(float32 default; the native step's slots keep a 16-bit file's dtype). Configurations, one process, one after another:

- base: the model without a ``lora:`` section, 16 requests;
- lora/base rows: the same requests on the LoRA engine, none with an adapter (the cost of the
  machinery alone);
- lora xN: the 16 requests spread round-robin over N adapters (one batch, ``max_loras`` 16);
- merged xN: each adapter merged into a copy of the weights (W + scale B A), one engine per
  adapter serving its share of the requests, engines one after another (load time not counted).
  On the demo GGUF a merged engine would be the same packed types and shapes as the base (a
  merged GGUF re-quantized), so the base engine serving each share in turn stands for it.

The first five run in interleaved rounds (``--repeats``), the median of each, as do each merged engine's.

Decode tokens/s counts the tokens of steps in which no sequence is in its prompt, over those
steps' time (``--clock cpu``: this process's CPU time, which on a loaded machine with
``--threads 1`` measures the work where wall time mostly measures the other jobs); ``--rate step``:
the median of the decode steps' own rates (rows / step time) instead, so that the steps another
job interrupted, outliers, do not count (for wall-clock ratios at 2 threads on a loaded machine).
The load average is printed before and after: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmplug import LLM, LoRARequest, SamplingParams

DEMO = "smollm2-135m-instruct"

SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
         "num_key_value_heads": 3, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_model(root: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SHAPE)).eval()
    path = root / "base"
    model.save_pretrained(path)
    return path


def make_adapter(targets: dict[str, tuple[int, int]], folder: Path, rank: int, seed: int,
                 dtype: torch.dtype = torch.float32) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A random adapter in PEFT's saved format over ``targets`` (module -> (in, out), the engine's
    ``adapters.targets``), stored in ``dtype``; returns module -> (A, B * scale) for merging."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for module, (d_in, d_out) in sorted(targets.items()):
        a = (torch.randn(rank, d_in, generator=g) / math.sqrt(d_in)).to(dtype)
        b = (torch.randn(d_out, rank, generator=g) * 0.02).to(dtype)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        deltas[module] = (a.float(), b.float() * 2.0)  # lora_alpha = 2 r
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}))
    return deltas


def merged_copy(base: Path, folder: Path, deltas) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, folder)
    weights = load_file(str(base / "model.safetensors"))
    for module, (a, b) in deltas.items():
        weights[f"{module}.weight"] = weights[f"{module}.weight"] + b @ a
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]
per_step = False  # --rate step


def decode_rate(llm: LLM, prompts: list[list[int]], loras: list, tokens: int) -> tuple[float, int]:
    """(decode tokens/s, decode tokens) of one batch of requests run to completion (seconds of
    ``clock``: wall, or this process's CPU time): over the decode steps' summed time, or with
    ``per_step`` the median of the steps' own rates."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for k, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{time.perf_counter_ns()}-{k}", prompt, params, lora=lora)
    spent, produced, rates = 0.0, 0, []
    while engine.has_unfinished_requests():
        seqs = [s for s in engine.requests.sequences() if not s.is_finished]
        decoding = not any(s.is_prefill for s in seqs)
        started = clock()
        engine.step()
        if decoding:
            took = clock() - started
            spent += took
            produced += len(seqs)
            rates.append(len(seqs) / took)
    return (statistics.median(rates) if per_step else produced / spent), produced


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("dense", "demo"), default="dense")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="torch")
    p.add_argument("--adapter-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="the dtype the adapter files store their weights in")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="cpu: per CPU-second of this process (with --threads 1: the work done, what a "
                        "loaded machine's waits do not change)")
    p.add_argument("--rate", choices=("batch", "step"), default="batch",
                   help="step: each round's median of its decode steps' own rates (a step another job "
                        "interrupted is an outlier it ignores: wall-clock ratios at 2 threads on a loaded machine)")
    a = p.parse_args()
    global clock, per_step
    clock, per_step = CLOCKS[a.clock], a.rate == "step"
    torch.set_num_threads(a.threads)
    print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}  (a shared machine: other jobs run)")
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        if a.model == "demo":
            from lmplug.loading.cache import pull

            base = Path(pull(DEMO))
            common = {"device": "cpu", "max_model_len": 256}  # otherwise the default config
        else:
            base = make_model(root, a.layers)
            common = {"dtype": "float32", "device": "cpu", "max_model_len": 256}
        common["scheduler"] = {"backend": "continuous", "max_num_seqs": a.requests}
        lora_cfg = {"backend": a.backend, "max_loras": 16, "max_lora_rank": a.rank}
        plain, served = LLM(str(base), **common), LLM(str(base), lora=lora_cfg, **common)
        dtype = getattr(torch, a.adapter_dtype)
        deltas = [make_adapter(served.engine.adapters.targets, root / f"a{k}", a.rank, k, dtype) for k in range(16)]
        g = torch.Generator().manual_seed(1)
        vocab = served.engine.model_config.vocab_size
        prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(a.requests)]
        requests = [LoRARequest(f"a{k}", k + 1, str(root / f"a{k}")) for k in range(16)]
        configs = {"base": (plain, [None] * a.requests), "lora/base rows": (served, [None] * a.requests)}
        for n in (1, 4, 16):
            configs[f"lora x{n}"] = (served, [requests[i % n] for i in range(a.requests)])
        for llm, loras in configs.values():  # warm-up (and every adapter read once)
            decode_rate(llm, prompts, loras, 2)
        runs: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(a.repeats):  # interleaved rounds, medians: the machine is shared
            for name, (llm, loras) in configs.items():
                runs[name].append(decode_rate(llm, prompts, loras, a.tokens)[0])
        rows = {name: statistics.median(rates) for name, rates in runs.items()}
        for name, llm in (("base", plain), ("lora", served)):
            print(f"{name} engine: native decode step {'on' if llm.engine.parts.model._native_step else 'off'}")
        served.close()
        for name in configs:
            print(f"{name:<22} {rows[name]:8.1f} decode tok/s  (median of {a.repeats}: "
                  f"{', '.join(f'{r:.1f}' for r in runs[name])})", flush=True)
        for n in (1, 4, 16):
            spent, produced = 0.0, 0
            for k in range(n):
                share = [p for i, p in enumerate(prompts) if i % n == k]
                if a.model == "demo":  # a merged GGUF runs as the base does (module docstring)
                    rate = statistics.median(decode_rate(plain, share, [None] * len(share), a.tokens)[0]
                                             for _ in range(a.repeats))
                else:
                    folder = merged_copy(base, root / f"merged{k}", deltas[k])
                    with LLM(str(folder), **common) as llm:
                        decode_rate(llm, share, [None] * len(share), 2)
                        rate = statistics.median(decode_rate(llm, share, [None] * len(share), a.tokens)[0]
                                                 for _ in range(a.repeats))
                    shutil.rmtree(folder)
                got = len(share) * (a.tokens - 1)
                spent, produced = spent + got / rate, produced + got
            rows[f"merged x{n}"] = produced / spent
            print(f"{'merged x' + str(n):<22} {produced / spent:8.1f} decode tok/s  (one engine per adapter "
                  f"with its {a.requests // n} requests, one after another; median of {a.repeats} each)", flush=True)
        plain.close()
        base_rate = rows["base"]
        print(f"\nratio to base ({a.model}, {a.clock} clock, {a.rate} rate, {a.threads} threads, "
              f"{a.adapter_dtype} adapters):")
        for name, rate in rows.items():
            print(f"  {name:<20} {rate / base_rate:5.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
