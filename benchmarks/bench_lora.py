"""Many LoRA adapters at once: decode throughput at 16 concurrent requests spread over 1, 4 and 16
adapters, against the base model alone and against one merged engine per adapter.

    python benchmarks/bench_lora.py [--layers 30] [--rank 8] [--requests 16] [--tokens 32] [--threads 2]

The model is a random Llama in SmolLM2-135M's shape (hidden 576, 9 heads over 3 KV heads, MLP
1536; ``--layers`` of them), float32 on the CPU, saved as an HF folder; each adapter a random PEFT
adapter of rank ``--rank`` on every attention and MLP projection. Configurations, one process,
one after another:

- base: the model without a ``lora:`` section, 16 requests;
- lora/base rows: the same requests on the LoRA engine, none with an adapter (the cost of the
  machinery alone);
- lora xN: the 16 requests spread round-robin over N adapters (one batch, ``max_loras`` 16);
- merged xN: each adapter merged into a copy of the weights (W + scale B A), one engine per
  adapter serving its share of the requests, engines one after another (load time not counted).

The first four run in interleaved rounds (``--repeats``), best of each, as do each merged engine's.

Decode tokens/s counts the tokens of steps in which no sequence is in its prompt, over those
steps' time. The load average is printed before and after: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lmplug import LLM, LoRARequest, SamplingParams

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


def make_adapter(base: Path, folder: Path, rank: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A random adapter in PEFT's saved format; returns module -> (A, B * scale) for merging."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            module = name.removesuffix(".weight")
            if module.rpartition(".")[2] not in TARGETS:
                continue
            d_out, d_in = f.get_slice(name).get_shape()
            a = torch.randn(rank, d_in, generator=g) / math.sqrt(d_in)
            b = torch.randn(d_out, rank, generator=g) * 0.02
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            deltas[module] = (a, b * 2.0)  # lora_alpha = 2 r
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


def decode_rate(llm: LLM, prompts: list[list[int]], loras: list, tokens: int) -> tuple[float, int]:
    """(decode tokens/s, decode tokens) of one batch of requests run to completion."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for k, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{time.perf_counter_ns()}-{k}", prompt, params, lora=lora)
    spent, produced = 0.0, 0
    while engine.has_unfinished_requests():
        seqs = [s for s in engine.requests.sequences() if not s.is_finished]
        decoding = not any(s.is_prefill for s in seqs)
        started = time.perf_counter()
        engine.step()
        if decoding:
            spent += time.perf_counter() - started
            produced += len(seqs)
    return produced / spent, produced


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="torch")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}  (a shared machine: other jobs run)")
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        base = make_model(root, a.layers)
        deltas = [make_adapter(base, root / f"a{k}", a.rank, k) for k in range(16)]
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, SHAPE["vocab_size"], (16,), generator=g).tolist() for _ in range(a.requests)]
        common = {"dtype": "float32", "device": "cpu", "max_model_len": 256,
                  "scheduler": {"backend": "continuous", "max_num_seqs": a.requests}}
        rows: dict[str, float] = {}
        lora_cfg = {"backend": a.backend, "max_loras": 16, "max_lora_rank": a.rank}
        requests = [LoRARequest(f"a{k}", k + 1, str(root / f"a{k}")) for k in range(16)]
        plain, served = LLM(str(base), **common), LLM(str(base), lora=lora_cfg, **common)
        configs = {"base": (plain, [None] * a.requests), "lora/base rows": (served, [None] * a.requests)}
        for n in (1, 4, 16):
            configs[f"lora x{n}"] = (served, [requests[i % n] for i in range(a.requests)])
        for llm, loras in configs.values():  # warm-up (and every adapter read once)
            decode_rate(llm, prompts, loras, 2)
        for _ in range(a.repeats):  # interleaved rounds, best of each: the machine is shared
            for name, (llm, loras) in configs.items():
                rows[name] = max(rows.get(name, 0.0), decode_rate(llm, prompts, loras, a.tokens)[0])
        plain.close()
        served.close()
        for name in configs:
            print(f"{name:<22} {rows[name]:8.1f} decode tok/s  (best of {a.repeats})", flush=True)
        for n in (1, 4, 16):
            spent, produced = 0.0, 0
            for k in range(n):
                share = [p for i, p in enumerate(prompts) if i % n == k]
                folder = merged_copy(base, root / f"merged{k}", deltas[k])
                with LLM(str(folder), **common) as llm:
                    decode_rate(llm, share, [None] * len(share), 2)
                    rate = max(decode_rate(llm, share, [None] * len(share), a.tokens)[0] for _ in range(a.repeats))
                shutil.rmtree(folder)
                got = len(share) * (a.tokens - 1)
                spent, produced = spent + got / rate, produced + got
            rows[f"merged x{n}"] = produced / spent
            print(f"{'merged x' + str(n):<22} {produced / spent:8.1f} decode tok/s  (one engine per adapter "
                  f"with its {a.requests // n} requests, one after another; best of {a.repeats} each)", flush=True)
        base_rate = rows["base"]
        print("\nratio to base:")
        for name, rate in rows.items():
            print(f"  {name:<20} {rate / base_rate:5.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
