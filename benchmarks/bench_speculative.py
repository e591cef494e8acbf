"""Speculative decoding vs plain decoding, batch 1, greedy, side by side in one run.

    python benchmarks/bench_speculative.py [--model smollm2-135m-instruct] [--max-tokens 128]
        [--threads 1] [--device auto] [--configs plain,ngram,layer_skip] [--layer-skip-layers 24]
        [--medusa-heads DIR]   # heads from: lmplug train-drafter --method medusa MODEL DIR
        [--medusa-tree PRESET_OR_JSON]  # adds medusa_tree: the same heads with tree candidates
        [--eagle-heads DIR]    # heads from: lmplug train-drafter --method eagle MODEL DIR
        [--configs ...,eagle_tree] [--eagle-tree-width 3]  # EAGLE's chain plus runner-up leaves
        [--mtp-path DIR]       # an MTP module from: lmplug train-drafter --method mtp MODEL DIR
        [--dflash-heads DIR]   # a DFlash head (muse_glimmer_assistant), e.g. from
                               # lmplug train-drafter --method dflash MODEL DIR
        [--dtype bfloat16] [--kv paged] [--repeats 1]
    # a random-weight GGUF (no n-gram ever matches): every verify still k + 1 rows
    python benchmarks/bench_speculative.py --model FILE.gguf --configs plain,layer_skip \
        --layer-skip-k 4 --layer-skip-layers 8 --sets copy

Two prompt sets: (a) *copy*: rewrite / fix / extract tasks whose answer copies from the
prompt, where n-gram lookup shines; (b) *free*: open-ended generation. Every config decodes
the same chat prompts; greedy output is compared with plain decoding's and printed: "yes",
or "NO (from token N)". In float32 it must be identical. In bfloat16 a draft tree's logits
come from a multi-token forward whose rounding differs, so a near-tie can flip; chain drafts
with ``--kv paged`` are read as decode rows and keep plain decoding's output. Per config and set: decode tokens/s (after the first token), target forwards per
request, tokens per target forward, acceptance rate, mean accepted drafts per verification,
and the decode speedup over plain; then the median time of a target forward by its rows (a verify
of k drafts: k + 1 rows) in plain decode steps, by wall time and (at one thread) by the thread's
CPU time, which a shared machine's other jobs disturb less. ``ngram`` runs the drafter's defaults
(``adaptive`` drafts, ``draft_length: cost``); ``ngram_fixed`` and ``layer_skip_fixed`` verify
every proposed draft (the earlier defaults). The configs run interleaved (each prompt through every
config in turn, ``--repeats`` times), so a shared machine's load drifts affect all alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmplug import LLM, SamplingParams

CODE = '''def count_words(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.lower().strip(".,;:!?")
                counts[word] = counts.get(word, 0) + 1
    return counts
'''
PARAGRAPH = ("The lighthouse stood on the edge of the cliff for more then a hundred years. Every nigth "
             "its keeper climbed the stairs, lit the lamp and watched the ships pass safely betwen the "
             "rocks. When the storm came, the keeper stayed awake untill morning.")
LOG = """2024-05-01 10:00:01 INFO server started on port 8080
2024-05-01 10:00:05 ERROR database connection refused (host=db1)
2024-05-01 10:00:09 INFO retrying connection
2024-05-01 10:00:12 ERROR database connection refused (host=db1)
2024-05-01 10:01:00 WARN slow request /api/users took 2300 ms
2024-05-01 10:02:30 ERROR disk quota exceeded on /var/log"""

PROMPT_SETS = {
    "copy": [
        "Add type hints and a docstring to this Python function. Reply with the full code only.\n\n" + CODE,
        "Fix the spelling mistakes in this paragraph and write out the whole corrected paragraph:\n\n"
        + PARAGRAPH,
        "Copy every line of this log that contains ERROR, exactly as written:\n\n" + LOG,
    ],
    "free": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a bicycle gear system works to a ten-year-old.",
    ],
}


def speculative_configs(args) -> dict[str, dict | None]:
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_tokens": args.ngram_k, "min_n": 2, "max_n": 4},
        # the defaults before draft_length `cost` and ngram's `adaptive`: every proposed draft verified
        "ngram_fixed": {"method": "ngram", "num_tokens": args.ngram_k, "min_n": 2, "max_n": 4, "adaptive": False,
                        "draft_length": "fixed"},
        "ngram_adaptive": {"method": "ngram", "num_tokens": args.ngram_adaptive_k, "min_n": 2, "max_n": 4,
                           "adaptive": True},
        "layer_skip": {"method": "layer_skip", "num_tokens": args.layer_skip_k,
                       "num_layers": args.layer_skip_layers},
        "layer_skip_fixed": {"method": "layer_skip", "num_tokens": args.layer_skip_k,
                             "num_layers": args.layer_skip_layers, "draft_length": "fixed"},
        "medusa": {"method": "medusa", "num_tokens": args.medusa_k, "heads": args.medusa_heads},
        "medusa_tree": {"method": "medusa", "num_tokens": args.medusa_k, "heads": args.medusa_heads,
                        "tree": _tree_arg(args.medusa_tree)},
        "eagle": {"method": "eagle", "num_tokens": args.eagle_k, "heads": args.eagle_heads},
        "eagle_tree": {"method": "eagle", "num_tokens": args.eagle_k, "heads": args.eagle_heads,
                       "tree_width": args.eagle_tree_width},
        "eagle_dynamic": {"method": "eagle", "num_tokens": args.eagle_dynamic_depth, "heads": args.eagle_heads,
                          "dynamic_tree": True, "top_k": args.eagle_top_k, "total_tokens": args.eagle_total_tokens},
        "mtp": {"method": "mtp", "num_tokens": args.mtp_k, "path": args.mtp_path},
        "dflash": {"method": "dflash", "heads": args.dflash_heads,
                   **({"num_tokens": args.dflash_k} if args.dflash_k else {})},
    }


def _tree_arg(value: str | None):
    """``--medusa-tree``: a preset name (default, mc_sim_7b_63) or a JSON list of rank paths."""
    if value is None or not value.lstrip().startswith("["):
        return value
    import json

    return json.loads(value)


def run_one(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> dict:
    """Decode one request alone; its target forwards (from its metrics) and decode time."""
    engine = llm.engine
    engine.add_request("bench", prompt_ids, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    m = out.metrics
    return {"tokens": out.token_ids, "forwards": m.num_target_forwards, "decode_s": m.finish_time - m.first_token_time,
            "drafted": m.num_drafted_tokens, "accepted": m.num_accepted_tokens}


def build(spec: dict | None, args) -> LLM:
    kv = {"kvcache": {"backend": "paged", "block_size": 16}, "attention": "paged"} if args.kv == "paged" else {}
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=2048, speculative=spec, **kv)
    run_one(llm, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    time_forwards(llm)
    return llm


# id(llm) -> clock -> rows of a target forward -> seconds
FORWARDS: dict[int, dict[str, dict[int, list[float]]]] = {}


def time_forwards(llm: LLM) -> None:
    """Time the engine's target forwards (``runner.execute``) by their row count: a verify of
    k drafts is k + 1 rows, a plain decode 1 (prefills are left out by ``forward_costs``). Two
    clocks: wall time, and the calling thread's CPU time, which leaves out the time other
    processes of a shared machine hold the core (at one thread the forward runs on that thread)."""
    runner = llm.engine.runner
    seen = FORWARDS.setdefault(id(llm), {"wall": {}, "cpu": {}})
    execute = runner.execute

    def timed(batch):
        start, cpu = time.perf_counter(), time.thread_time()
        result = execute(batch)
        rows = sum(s.num_new_tokens for s in batch)
        seen["cpu"].setdefault(rows, []).append(time.thread_time() - cpu)
        seen["wall"].setdefault(rows, []).append(time.perf_counter() - start)
        return result

    runner.execute = timed


def bench_all(configs: dict[str, dict | None], args, prompts: dict[str, list[list[int]]]) -> dict:
    """results[config][set] = one run per prompt and repeat; configs interleaved per prompt."""
    llms = {name: build(spec, args) for name, spec in configs.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: dict = {name: {s: [] for s in prompts} for name in configs}
    for llm in llms.values():
        for by_rows in FORWARDS[id(llm)].values():
            by_rows.clear()  # the warm-up's
    for _ in range(args.repeats):
        for set_name, ids_list in prompts.items():
            for ids in ids_list:
                for name, llm in llms.items():
                    results[name][set_name].append(run_one(llm, ids, params))
    results["_forwards"] = {name: FORWARDS[id(llm)] for name, llm in llms.items()}
    return results


def forward_costs(forwards: dict[str, dict[str, dict[int, list[float]]]], threads: int) -> None:
    """Median ms of a target forward by rows (2-17: verifies; 1: decodes), and each in plain
    decode steps (the plain config's 1-row median): by wall time, and at one thread by the
    thread's CPU time too."""
    for clock in ("wall", "cpu") if threads == 1 else ("wall",):
        base = statistics.median(forwards["plain"][clock].get(1, [float("nan")]))
        print(f"target forward medians, {clock} time (ms; in plain decode steps of {base * 1e3:.2f} ms):")
        for name, by_clock in forwards.items():
            cells = [f"{rows} rows {statistics.median(t) * 1e3:.2f} ({statistics.median(t) / base:.2f}, n={len(t)})"
                     for rows, t in sorted(by_clock[clock].items()) if rows <= 17 and len(t) >= 3]
            print(f"  {name:15} " + "; ".join(cells))


def summarize(runs: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) for r in runs)
    decoded = sum(len(r["tokens"]) - 1 for r in runs)
    verified = sum(r["forwards"] - 1 for r in runs)  # the first forward is the prompt's
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    return {"tok_s": decoded / sum(r["decode_s"] for r in runs), "forwards": sum(r["forwards"] for r in runs) / len(runs),
            "tok_per_fwd": tokens / sum(r["forwards"] for r in runs),
            "acceptance": accepted / drafted if drafted else float("nan"),
            "mean_accepted": accepted / verified if verified else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--sets", default="copy,free", help="prompt sets to run: copy (a), free (b)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv", default="contiguous", choices=["contiguous", "paged"],
                   help="contiguous: kvcache contiguous + attention sdpa (the CPU defaults); paged: kvcache "
                        "paged + attention paged (on CPU a verify's chain drafts are read as decode rows "
                        "by the C kernel, paged_rows.py)")
    p.add_argument("--configs", default="plain,ngram,layer_skip",
                   help="comma-separated: plain, ngram, ngram_fixed, ngram_adaptive, layer_skip_fixed, layer_skip, medusa, medusa_tree, eagle, "
                        "eagle_tree, eagle_dynamic, mtp, dflash")
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--ngram-adaptive-k", type=int, default=16, help="most drafts of the ngram_adaptive config")
    p.add_argument("--layer-skip-k", type=int, default=2)
    p.add_argument("--layer-skip-layers", type=int, default=24)
    p.add_argument("--medusa-heads", help="heads folder (lmplug train-drafter --method medusa); "
                                          "adds the medusa config")
    p.add_argument("--medusa-k", type=int, default=2)
    p.add_argument("--medusa-tree", help="Medusa tree candidates: a preset (default, mc_sim_7b_63) or JSON "
                                         "rank paths such as '[[0],[1],[0,0]]'; adds the medusa_tree config "
                                         "(needs --medusa-heads)")
    p.add_argument("--eagle-heads", help="heads folder (lmplug train-drafter --method eagle); adds the eagle config")
    p.add_argument("--eagle-k", type=int, default=3)
    p.add_argument("--eagle-tree-width", type=int, default=3,
                   help="candidates per depth of the eagle_tree config (the chain plus runner-up leaves)")
    p.add_argument("--eagle-dynamic-depth", type=int, default=3, help="eagle_dynamic (EAGLE-2): tree depth")
    p.add_argument("--eagle-top-k", type=int, default=4, help="eagle_dynamic: nodes expanded per depth")
    p.add_argument("--eagle-total-tokens", type=int, default=10, help="eagle_dynamic: nodes verified per step")
    p.add_argument("--mtp-path", help="MTP module folder (lmplug train-drafter --method mtp); adds the mtp config")
    p.add_argument("--mtp-k", type=int, default=3)
    p.add_argument("--dflash-heads", help="DFlash head folder (muse_glimmer_assistant, or lmplug train-drafter "
                                          "--method dflash); adds the dflash config")
    p.add_argument("--dflash-k", type=int, default=0, help="dflash drafts per step (0: the head's block_size - 1)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (configs interleaved)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    configs = speculative_configs(args)
    chosen = args.configs.split(",")
    if args.medusa_heads and "medusa" not in chosen:
        chosen.append("medusa")
    if args.medusa_tree and "medusa_tree" not in chosen:
        chosen.append("medusa_tree")
    if args.eagle_heads and "eagle" not in chosen:
        chosen.append("eagle")
    if args.mtp_path and "mtp" not in chosen:
        chosen.append("mtp")
    if args.dflash_heads and "dflash" not in chosen:
        chosen.append("dflash")
    if "plain" not in chosen:
        chosen.insert(0, "plain")
    tok_llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=2048)
    prompts = {s: [_prompt_ids(tok_llm, t) for t in texts] for s, texts in PROMPT_SETS.items()
               if s in args.sets.split(",")}
    del tok_llm
    print(f"model {args.model}, batch 1, greedy, max_tokens {args.max_tokens}, device {args.device}, "
          f"{args.threads} CPU thread(s)")
    results = bench_all({name: configs[name] for name in chosen}, args, prompts)
    report(results, configs, args.threads)


def _prompt_ids(llm: LLM, text: str) -> list[int]:
    """``text`` as one user message in the model's chat template; plainly encoded without one (a
    tiny test model, as the drafter trainers prompt it)."""
    if llm.tokenizer.chat_template:
        return llm.apply_chat_template([{"role": "user", "content": text}])
    return llm.tokenizer.encode(text)


def _first_difference(runs: list[dict], plain: list[dict]) -> int | None:
    """None when every run's tokens equal plain decoding's, else the earliest differing index (a
    speculative run in bf16 may flip a near-tie: its logits come from a multi-token forward)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                   None if len(a["tokens"]) == len(b["tokens"]) else min(len(a["tokens"]), len(b["tokens"])))
              for a, b in zip(runs, plain)]
    firsts = [f for f in firsts if f is not None]
    return min(firsts) if firsts else None


def report(results: dict, configs: dict, threads: int) -> None:
    forwards = results.pop("_forwards")
    header = f"{'set':5} {'config':15} {'decode tok/s':>12} {'speedup':>8} {'fwd/req':>8} {'tok/fwd':>8} " \
             f"{'accept':>7} {'acc/step':>8}  same output"
    print(header)
    print("-" * len(header))
    for set_name in next(iter(results.values())):
        base = summarize(results["plain"][set_name])
        for name, by_set in results.items():
            s = summarize(by_set[set_name])
            same = _first_difference(by_set[set_name], results["plain"][set_name])
            print(f"{set_name:5} {name:15} {s['tok_s']:12.2f} {s['tok_s'] / base['tok_s']:7.2f}x "
                  f"{s['forwards']:8.1f} {s['tok_per_fwd']:8.2f} {s['acceptance']:7.2f} {s['mean_accepted']:8.2f}"
                  f"  {'yes' if same is None else f'NO (from token {same})'}")
    for name, spec in configs.items():
        if name in results and spec:
            print(f"  {name}: {spec}")
    forward_costs(forwards, threads)


if __name__ == "__main__":
    main()
