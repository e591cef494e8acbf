"""Prompt compression's quality and speed on a seeded long-context retrieval set.

    python benchmarks/bench_compression.py [--items 200] [--context-tokens 2048] [--rates 0.5 0.33]
                                           [--methods truncate selective llmlingua] [--seed 0]
                                           [--scorer MODEL]

Each item is a chat with one user message: distractor paragraphs (seeded filler sentences, plus
decoy facts about other doors), one planted fact ("The access code for the <color> <thing> is
<4 digits>.") at a random paragraph, and a final question asking for that code (the final
paragraph: protected), ``--context-tokens`` target tokens in all. The target is the engine's
default config (the demo model); the scorer is the target model itself unless ``--scorer`` names
another (``compression.scorer``).

For the full prompt and each method at each rate: accuracy (the code appears in the greedy
answer), mean KL(full || compressed) of the answer tokens' distributions (the full prompt's
greedy answer teacher-forced after both prompts; over the full prompt's top-``--kl-top`` tokens
per position plus one bucket for the rest, a token outside the compressed prompt's top list being
given that list's last probability), prompt tokens, TTFT (the engine's, plus the compressor's time
for compressed prompts: end to end) and the compressor's own time. Compression times exclude the
scorer's one-time load (a warm-up item runs first). The load average is printed: this is a shared
CPU, so read ratios rather than absolute times.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time

from lmplug import LLM, SamplingParams

COLORS = ["red", "blue", "green", "amber", "violet", "silver", "black", "white", "orange", "gray"]
THINGS = ["door", "gate", "locker", "vault", "safe", "cabinet", "hatch", "chest", "drawer", "box"]
FILLER = ["The committee reviewed the quarterly figures and agreed to postpone the decision", "Rain fell over the valley for most of the afternoon, and the river rose slowly", "Several visitors asked about the history of the old mill near the bridge", "The library extended its opening hours during the examination period", "A new bakery opened on the corner and quickly drew a loyal crowd", "The engineers replaced the worn bearings before the next inspection", "Most of the orchard was harvested before the first frost arrived", "The choir practiced twice a week in the hall behind the school", "Traffic was diverted while the crews repaired the northern road", "The museum acquired a collection of maps drawn by a local surveyor."]


def make_item(rng: random.Random, context_tokens: int, count=len) -> tuple[str, str]:
    """(user message, the code): paragraphs, then the question, ~``context_tokens`` tokens by
    ``count`` (the target's token counter; the default counts characters)."""
    color, thing = rng.choice(COLORS), rng.choice(THINGS)
    code = f"{rng.randint(1000, 9999)}"
    paragraphs: list[str] = []
    while len(paragraphs) < 2 or count("\n\n".join(paragraphs)) < context_tokens - 60:  # facts, question
        paragraphs.append(". ".join(rng.sample(FILLER, 4)).rstrip(".") + ".")
    for _ in range(3):  # decoys: other doors, other codes
        c, t = rng.choice([x for x in COLORS if x != color]), rng.choice(THINGS)
        k = rng.randrange(len(paragraphs))
        paragraphs[k] += f" The access code for the {c} {t} is {rng.randint(1000, 9999)}."
    k = rng.randrange(len(paragraphs))
    paragraphs[k] += f" The access code for the {color} {thing} is {code}."
    question = f"Question: what is the access code for the {color} {thing}? Answer with the code only."
    return "\n\n".join(paragraphs) + "\n\n" + question, code


def answer_dists(llm: LLM, messages: list[dict], answer: list[int], top: int) -> list[dict[int, float]]:
    """Per answer position, the top-``top`` log-probabilities of the next token, teacher-forced."""
    ids = llm.apply_chat_template(messages)
    out = llm.generate({"prompt_token_ids": ids + answer}, SamplingParams(max_tokens=1, prompt_logprobs=top),
                       compression=False)[0]
    rows = out.prompt_logprobs[len(ids):]
    return [{t: lp.logprob for t, lp in row.items()} for row in rows]


def kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over p's listed tokens plus one bucket for the rest (see the module)."""
    floor = min(q.values())
    total, p_rest, q_rest = 0.0, 1.0, 1.0
    for t, lp in p.items():
        lq = q.get(t, floor)
        total += math.exp(lp) * (lp - lq)
        p_rest -= math.exp(lp)
        q_rest -= math.exp(lq)
    p_rest, q_rest = max(p_rest, 1e-9), max(q_rest, 1e-9)
    return max(0.0, total + p_rest * math.log(p_rest / q_rest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.33])
    ap.add_argument("--methods", nargs="+", default=["truncate", "selective", "llmlingua"])
    ap.add_argument("--max-tokens", type=int, default=20)
    ap.add_argument("--kl-top", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-every", type=int, default=10, help="print the table every N items, and at the end")
    ap.add_argument("--scorer", default=None, help="the scoring model (default: the target's own)")
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    scorer = {} if args.scorer is None else {"scorer": args.scorer}
    llm = LLM(max_model_len=max(2048, args.context_tokens + 256),
              compression={"method": args.methods[0], **scorer})
    rng = random.Random(args.seed)
    count = llm.compressor.count_tokens
    items = [make_item(rng, args.context_tokens, count) for _ in range(args.items)]
    configs = [("full", None, None)] + [(m, m, r) for r in args.rates for m in args.methods]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = [{"role": "user", "content": make_item(random.Random(-1), 200)[0]}]
    for method in args.methods:  # load the scorer once, outside the timings
        llm.chat(warm, greedy, compression={"method": method, "rate": 0.5})
    stats = {name: {"ok": [], "kl": [], "tokens": [], "ttft": [], "comp": []} for name in
             (c[0] if c[1] is None else f"{c[0]}@{c[2]}" for c in configs)}
    started = time.perf_counter()
    for n, (text, code) in enumerate(items):
        messages = [{"role": "user", "content": text}]
        full_answer, full_dists = None, None
        for name, method, rate in configs:  # the configs take turns on each item
            key = name if method is None else f"{name}@{rate}"
            sent, comp = messages, 0.0
            if method is not None:
                sent, report = llm.compressor.compress_messages(messages, {"method": method, "rate": rate})
                comp = report.seconds
            out = llm.chat(sent, greedy, compression=False)[0]
            s = stats[key]
            s["ok"].append(code in out.text)
            s["tokens"].append(len(out.prompt_token_ids))
            s["comp"].append(comp)
            s["ttft"].append(out.metrics.ttft + comp)
            if method is None:
                full_answer = out.token_ids
                full_dists = answer_dists(llm, messages, full_answer, args.kl_top)
                s["kl"].append(0.0)
            else:
                dists = answer_dists(llm, sent, full_answer, args.kl_top)
                s["kl"].append(statistics.fmean(kl(p, q) for p, q in zip(full_dists, dists)))
        print(f"item {n + 1}/{len(items)} done ({time.perf_counter() - started:.0f} s)", flush=True)
        if (n + 1) % args.report_every == 0 or n + 1 == len(items):
            print_table(stats, n + 1, args)


def print_table(stats: dict, done: int, args: argparse.Namespace) -> None:
    """The table over the first ``done`` items (printed every ``--report-every`` items)."""
    full_acc = statistics.fmean(stats["full"]["ok"])
    print(f"\n{done} items, ~{args.context_tokens} context tokens, seed {args.seed}, "
          f"load average now {os.getloadavg()[0]:.1f}")
    print(f"{'config':<16} {'accuracy':>8} {'vs full':>8} {'KL':>7} {'tokens':>7} {'TTFT s':>7} {'comp s':>7}")
    for key, s in stats.items():
        acc = statistics.fmean(s["ok"])
        rel = f"{acc / full_acc:.0%}" if full_acc else "-"
        print(f"{key:<16} {acc:>8.0%} {rel:>8} {statistics.fmean(s['kl']):>7.3f} "
              f"{statistics.fmean(s['tokens']):>7.0f} {statistics.fmean(s['ttft']):>7.2f} "
              f"{statistics.fmean(s['comp']):>7.2f}", flush=True)

if __name__ == "__main__":
    main()
