"""A feature drafter's own forwards (an EAGLE head's, an MTP module's decoder layer) through the
native decode step against the Python layer, side by side in one process.

    python benchmarks/bench_draft_forward.py [--model smollm2-135m-instruct] [--threads 1]
        [--num-tokens 4] [--max-tokens 64] [--rounds 5]
        [--eagle-heads DIR]   # default: a random head of the model's shape (timing only)
        [--mtp-path DIR]      # e.g. lmplug train-drafter --method mtp MODEL DIR -o num_prompts=4
                              #      -o max_tokens=8 -o epochs=1 (none: MTP left out)

Each drafter is built once; every round generates the same greedy request with its layer's
native plan and then without it (the drafter's plan switched off on the same engine: the target
runs as it does by default, natively, in both). Greedy output is the same either way, so both
halves make the same ``propose`` calls; per half the median over rounds of the time in
``propose`` per call and in the drafter's forwards (``_compute``: embedding, fc / eh_proj and the
layer) per call, by wall time and by the thread's CPU time (at one thread the forward runs on it),
and the ratio Python / native.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from lmplug import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def random_eagle_heads(llm: LLM, folder: str) -> str:
    """A random-weight EAGLE head of the target's shape, in the published layout."""
    from lmplug_speculative.eagle_head import EagleHead, head_config, save_head

    cfg = llm.engine.parts.model_config
    raw = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "head_dim": cfg.head_dim, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
           "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu"}
    torch.manual_seed(0)
    save_head(EagleHead(head_config(raw)), folder, raw)
    return folder


def switch(drafter, method: str):
    """A function turning the drafter's native plan on (True) or off (False)."""
    attr, off = ("_native", None) if method == "eagle" else ("_native_step", False)
    owner = drafter if method == "eagle" else drafter.mtp
    plan = getattr(owner, attr)

    def set_native(on: bool) -> None:
        setattr(owner, attr, plan if on else off)

    return plan, set_native


def timed(drafter, name: str, clocks: dict) -> None:
    inner = getattr(drafter, name)

    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        out = inner(*args, **kwargs)
        clocks[name].append((time.perf_counter() - start, time.thread_time() - cpu))
        return out

    setattr(drafter, name, wrapper)


def bench(llm: LLM, method: str, args) -> None:
    drafter = llm.engine.speculator.drafter
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up: plans built
    plan, set_native = switch(drafter, method)
    if not plan:
        print(f"{method}: no native plan here (threads, dtype, cpu.native_step or no C compiler)")
        return
    clocks = {"propose": [], "_compute": []}
    timed(drafter, "propose", clocks)
    timed(drafter, "_compute", clocks)
    per = {True: {"propose": [], "_compute": []}, False: {"propose": [], "_compute": []}}
    outputs = {}
    for _ in range(args.rounds):
        for native in (True, False):
            set_native(native)
            for c in clocks.values():
                c.clear()
            outputs[native] = llm.generate([PROMPT], params)[0].outputs[0].token_ids
            for name, c in clocks.items():
                per[native][name].append(tuple(sum(x) / len(c) for x in zip(*c)))
    set_native(True)
    same = "yes" if outputs[True] == outputs[False] else "NO"
    print(f"\n{method}: {len(clocks['propose'])} propose calls, {len(clocks['_compute'])} forwards a request; "
          f"same tokens native/Python: {same}")
    print(f"{'':10} {'native ms':>10} {'Python ms':>10} {'Py/nat':>7} {'native cpu':>11} {'Python cpu':>11} "
          f"{'Py/nat cpu':>10}")
    for name in ("propose", "_compute"):
        nat = [statistics.median(x[i] for x in per[True][name]) * 1e3 for i in (0, 1)]
        py = [statistics.median(x[i] for x in per[False][name]) * 1e3 for i in (0, 1)]
        print(f"{name:10} {nat[0]:10.3f} {py[0]:10.3f} {py[0] / nat[0]:7.2f} {nat[1]:11.3f} {py[1]:11.3f} "
              f"{py[1] / nat[1]:10.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eagle-heads")
    ap.add_argument("--mtp-path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().strip()}; threads {args.threads}")
    engine = {"dtype": "float32", "device": "cpu", "max_model_len": 1024}
    with tempfile.TemporaryDirectory() as tmp:
        heads = args.eagle_heads or random_eagle_heads(LLM(args.model, **engine), tmp)
        drafters = {"eagle": {"heads": heads}, **({"mtp": {"path": args.mtp_path}} if args.mtp_path else {})}
        for method, options in drafters.items():
            spec = {"method": method, "num_tokens": args.num_tokens, "draft_length": "fixed", **options}
            bench(LLM(args.model, speculative=spec, **engine), method, args)
    with open("/proc/loadavg") as f:
        print(f"\nload average: {f.read().strip()}")


if __name__ == "__main__":
    main()
