"""Acceptance rules side by side: quality against speed for exact, typical, cascade and route.

    python benchmarks/bench_acceptance.py [--model smollm2-135m-instruct] [--max-tokens 64]
        [--drafter layer_skip] [--layer-skip-layers 12] [--k 3] [--temperature 1.0] [--threads 1]
        [--drafter mtp --mtp-path DIR]     # a module from: lmplug train-drafter --method mtp MODEL DIR
        [--drafter eagle --eagle-heads DIR]  # heads from: lmplug train-drafter --method eagle MODEL DIR

One target (the demo model by default), one drafter engine (``layer_skip``: the target's first
layers and its head; ``mtp`` / ``eagle``: a trained module or head; each gives the distributions
``q`` the cascade and route rules need; ``ngram`` has no ``q``, so under it cascade and route
defer everywhere), and plain decoding. Each configuration is
an acceptance rule set on the same speculative engine before its run; the configurations run
interleaved (each prompt through every one in turn, ``--repeats`` times), sampled (temperature 1,
no filters, so the shaped target p is the model's own distribution), seeded alike.

Per configuration: decode tokens/s and the speed-up over plain decoding; tokens per target
forward; mean KL(p || emitted) per token, where "emitted" is the law the rule drew that token
from (``AcceptanceRule.emitted_distribution`` at drafted positions, p for the token the target
chose), recorded from the verifier's own p and q as the rules run; perplexity of the emitted
text under the target (from the engine's logprobs of the chosen tokens, raw distribution).
Exact's KL is 0 by construction; its perplexity is the reference for the others. The load
average is printed before and after.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from lmplug import LLM, SamplingParams
from lmplug.interfaces.acceptance import Decision
from lmplug.plugins import get_registry

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle gear system works to a ten-year-old.",
    "List five tips for keeping a vegetable garden healthy in summer.",
]


def rule_configs(args) -> dict[str, dict]:
    """name -> the ``acceptance`` options (exact first: the reference)."""
    out = {"exact": {"rule": "exact"}}
    for eps in args.typical:
        out[f"typical eps={eps:g}"] = {"rule": "typical", "posterior_threshold": eps,
                                       "posterior_alpha": math.sqrt(eps)}
    for alpha in args.cascade:
        out[f"cascade {args.deferral} a={alpha:g}"] = {"rule": "cascade", "deferral": args.deferral, "alpha": alpha}
    for threshold in args.route:
        out[f"route t={threshold:g}"] = {"rule": "route", "threshold": threshold}
    return out


def build_rule(options: dict):
    options = dict(options)
    info = get_registry().get("acceptance", options.pop("rule"))
    return info.cls(info.cls.Options(**options))


FLOOR = 1e-45  # float32's smallest positive value: a draft probability that underflowed to 0 is below it


def kl(p: torch.Tensor, emitted: torch.Tensor) -> float:
    """KL(p || emitted) in nats. The distributions are float32 softmaxes over the whole vocabulary,
    whose tails underflow to 0; emitted is floored at ``FLOOR`` there (a lower bound on those terms,
    instead of an infinity that only says a tail underflowed)."""
    p, e = p.double(), emitted.double().clamp(min=FLOOR)
    e = e / e.sum()
    keep = p > 0
    return float((p[keep] * (p[keep].log() - e[keep].log())).sum())


class Recorder:
    """Wraps a rule's ``accept`` to record, at every emitted position, KL(p || the law it emitted
    from): drafted positions reached use the rule's ``emitted_distribution``, the bonus p."""

    def __init__(self, rule) -> None:
        self.rule, self.kls = rule, []
        inner = rule.accept

        def accept(p, q, draft, generator) -> Decision:
            m, tokens = inner(p, q, draft, generator)
            for j in range(len(tokens)):
                law = p[j] if j >= len(draft) else rule.emitted_distribution(
                    p[j], None if q is None else q[j], draft[j])
                self.kls.append(kl(p[j], law))
            return Decision(m, tokens)

        rule.accept = accept


def run_one(llm: LLM, ids: list[int], params: SamplingParams) -> dict:
    engine = llm.engine
    engine.add_request("bench", ids, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    m = out.metrics
    logprobs = [row[t].logprob for row, t in zip(out.logprobs, out.token_ids)]
    return {"tokens": len(out.token_ids), "forwards": m.num_target_forwards,
            "decode_s": m.finish_time - m.first_token_time, "nll": -sum(logprobs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--drafter", default="layer_skip", choices=["layer_skip", "ngram", "mtp", "eagle"])
    ap.add_argument("--mtp-path", help="the mtp drafter's module folder (lmplug train-drafter --method mtp)")
    ap.add_argument("--eagle-heads", help="the eagle drafter's heads folder (lmplug train-drafter --method eagle)")
    ap.add_argument("--layer-skip-layers", type=int, default=12)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--typical", type=float, nargs="*", default=[0.05, 0.15, 0.3], help="epsilons (delta = sqrt)")
    ap.add_argument("--cascade", type=float, nargs="*", default=[0.0, 0.05, 0.15], help="cascade alphas")
    ap.add_argument("--deferral", default="opt", choices=["opt", "chow", "diff"], help="the cascade's deferral rule")
    ap.add_argument("--route", type=float, nargs="*", default=[0.9, 0.6, 0.3], help="confidence thresholds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    drafter = {"method": args.drafter, "num_tokens": args.k}
    if args.drafter == "layer_skip":
        drafter["num_layers"] = args.layer_skip_layers
    elif args.drafter == "mtp":
        drafter["path"] = args.mtp_path
    elif args.drafter == "eagle":
        drafter["heads"] = args.eagle_heads
    plain = LLM(args.model, dtype="float32", device="cpu")
    spec = LLM(args.model, dtype="float32", device="cpu", speculative={**drafter, "acceptance": "exact"})
    prompts = [plain.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS[:args.prompts]]
    configs = {name: Recorder(build_rule(opts)) for name, opts in rule_configs(args).items()}
    results: dict[str, list[dict]] = {name: [] for name in ["plain", *configs]}
    for llm in (plain, spec):  # warm-up
        run_one(llm, prompts[0][:8], SamplingParams(temperature=0, max_tokens=4, logprobs=0))
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                    seed=1000 * rep + i, logprobs=0)
            results["plain"].append(run_one(plain, ids, params))
            for name, recorder in configs.items():
                spec.engine.speculator.rule = recorder.rule
                results[name].append(run_one(spec, ids, params))
    print(f"load average after: {os.getloadavg()}")
    report(results, configs, args)


def report(results: dict, configs: dict, args) -> None:
    def speed(runs):
        return sum(r["tokens"] - 1 for r in runs) / sum(r["decode_s"] for r in runs)

    base = speed(results["plain"])
    print(f"model {args.model}, drafter {args.drafter}"
          + (f" ({args.layer_skip_layers} layers)" if args.drafter == "layer_skip" else "")
          + f", k={args.k}, temperature {args.temperature}, max_tokens {args.max_tokens}, "
          f"{len(results['plain'])} runs per config, {args.threads} thread(s)")
    print(f"{'config':20} {'tok/s':>7} {'speedup':>8} {'tok/fwd':>8} {'KL/token':>9} {'ppl':>7}")
    for name, runs in results.items():
        tokens = sum(r["tokens"] for r in runs)
        per_fwd = tokens / sum(r["forwards"] for r in runs)
        ppl = math.exp(sum(r["nll"] for r in runs) / tokens)
        kls = configs[name].kls if name in configs else []
        mean_kl = f"{sum(kls) / len(kls):9.4f}" if kls else f"{'-':>9}"
        print(f"{name:20} {speed(runs):7.1f} {speed(runs) / base:7.2f}x {per_fwd:8.2f} {mean_kl} {ppl:7.2f}")


if __name__ == "__main__":
    main()
