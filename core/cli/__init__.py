"""``lmplug generate | chat | serve | plugins | models | quantize | eval | bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from lmplug.cli.args import CommandParser, engine_args, sampling_args
from lmplug.cli.checks import check_port, label_set_error, version_text
from lmplug.cli.serve_flags import add_serve_arguments
from lmplug.errors import LmplugError

DEFAULT_CHAT_SYSTEM = None


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:2] == ["bench", "serve"]:  # a load test of running servers: no engine, flags of its own
        return _guarded(_bench_serve, given[2:])
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --role pd` starts children with it
    if not sys.stderr.isatty():  # progress bars (tqdm, here and in worker processes) flood logs
        os.environ.setdefault("TQDM_DISABLE", "1")
    logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return _guarded(args.func, args)


def _bench_serve(argv: list[str]) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise LmplugError("lmplug bench serve needs httpx: pip install httpx (or 'lmplug[bench]')") from None
    from lmplug.serve.bench_serve_cli import main as bench_serve

    return bench_serve(argv)


def _guarded(func, arg: Any) -> int:
    """Run a command: lmplug's own errors are one line on stderr (exit 2), never a traceback."""
    try:
        return func(arg) or 0
    except LmplugError as exc:
        print(f"lmplug: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    _merge_model_option(args)
    for key in ("model", "dtype", "device", "max_model_len", "attention", "kvcache", "scheduler"):
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    if getattr(args, "tp", None) is not None:
        out.setdefault("parallel", {})["tensor_parallel_size"] = args.tp
    if getattr(args, "pp", None) is not None:
        out.setdefault("parallel", {})["pipeline_parallel_size"] = args.pp
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise LmplugError(f"--set {item!r}: expected KEY=VALUE")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
            raise LmplugError(f"--set {item}: the value of {key!r} is not valid YAML ({problem}); "
                              "quote it for a plain string") from None
        head, _, rest = key.partition(".")
        if rest:
            section = out.get(head)
            section = {"backend": section} if isinstance(section, str) else dict(section or {})
            section[rest] = value
            out[head] = section
        else:
            out[head] = value
    return out


def _merge_model_option(args: argparse.Namespace) -> None:
    """``serve``: ``--model M`` and the positional ``M`` are one setting."""
    option = getattr(args, "model_option", None)
    if option is None:
        return
    if getattr(args, "model", None) not in (None, option):
        raise LmplugError(f"--model {option!r} and the positional MODEL {args.model!r} differ; give one")
    args.model = option


def _build_llm(args: argparse.Namespace, adjust: Callable[[dict[str, Any]], dict[str, Any]] | None = None):
    """``adjust``: a function of the overrides (``serve --role`` adds its KV connector)."""
    from lmplug.errors import ConfigError
    from lmplug.llm import LLM

    started = time.perf_counter()
    overrides = _overrides(args) if adjust is None else adjust(_overrides(args))
    try:
        llm = LLM(config=args.config, **overrides)
    except ConfigError as exc:
        raise ConfigError(label_set_error(str(exc), args)) from None
    args._load_time = time.perf_counter() - started
    return llm


def _params(args: argparse.Namespace):
    from lmplug.interfaces.params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
                          ignore_eos=args.ignore_eos)


# -- commands ----------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    params = _params(args)
    prompts = args.prompt or [sys.stdin.read()]
    for prompt in prompts:
        if args.chat:
            prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
        started = time.perf_counter()
        first = last = None
        final = None
        for out in llm.stream(prompt, params):
            now = time.perf_counter()
            if first is None and out.delta_token_ids:
                first = now
            last = now
            print(out.delta_text, end="", flush=True)
            final = out
        print()
        if args.stats and final is not None:
            _print_stats(len(final.token_ids), started, first, last, args._load_time)
            if llm.engine.speculator is not None and final.metrics is not None:
                print(f"[lmplug] speculative: {final.metrics.spec_summary(len(final.token_ids))}", file=sys.stderr)
    return 0


def _print_stats(n: int, started: float, first: float | None, last: float | None, load: float) -> None:
    ttft = (first - started) if first else float("nan")
    tpot = (last - first) / (n - 1) if first and last and n > 1 else float("nan")
    total = (last - started) if last else float("nan")
    print(f"\n[lmplug] load {load:.2f} s | {n} tokens | TTFT {ttft * 1000:.1f} ms | "
          f"TPOT {tpot * 1000:.1f} ms | {1 / tpot if tpot > 0 else float('nan'):.1f} tokens/s "
          f"decode | {n / total if total > 0 else float('nan'):.1f} tokens/s overall",
          file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    params = _params(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("lmplug chat: type a message; /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    prompt = "you> " if sys.stdin.isatty() else ""  # no prompts in piped output
    while True:
        try:
            line = input(prompt)
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        reply = ""
        for out in llm.stream(llm.apply_chat_template(messages), params):
            print(out.delta_text, end="", flush=True)
            reply = out.text
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    from lmplug.serve.server import serve_from_args

    check_port(args.host, args.port)  # before the model loads, which can take minutes
    if args.role != "single":  # prefill/decode disaggregation
        from lmplug.serve.roles import serve_role

        return serve_role(args, _build_llm)
    return serve_from_args(args, _build_llm(args, _with_lora(args)))


def _with_lora(args: argparse.Namespace) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The overrides with a ``lora:`` section when a LoRA flag asks for one (vLLM's flags)."""
    def adjust(overrides: dict[str, Any]) -> dict[str, Any]:
        sizes = {key: value for key, value in (("max_loras", args.max_loras), ("max_lora_rank", args.max_lora_rank))
                 if value is not None}
        if args.lora_modules or args.enable_lora or sizes:
            section = overrides.get("lora")
            overrides["lora"] = {**(section if isinstance(section, dict) else {}), **sizes}
        return overrides
    return adjust


def cmd_plugins(args: argparse.Namespace) -> int:
    from lmplug.families import FAMILIES
    from lmplug.plugins import get_registry

    registry = get_registry()
    if args.check:
        return _check_backend(registry, args.check, args.option, args.device, args.hf_config)
    if args.device != "cpu":
        raise LmplugError(f"--device {args.device}: only applies to --check")
    rows = []
    for family in FAMILIES:
        for name, info in sorted(registry.backends(family).items()):
            rows.append((family, name, info.distribution, info.cls.capabilities.describe()))
    widths = [max(len(r[i]) for r in rows + [("family", "name", "distribution", "")]) for i in range(3)]
    print(f"{'family':<{widths[0]}}  {'name':<{widths[1]}}  {'distribution':<{widths[2]}}  capabilities")
    for fam, name, dist, caps in rows:
        print(f"{fam:<{widths[0]}}  {name:<{widths[1]}}  {dist:<{widths[2]}}  {caps}")
    for failure in registry.failures:
        print(f"FAILED  {failure}", file=sys.stderr)
    return 1 if registry.failures else 0


def _check_backend(registry, name: str, options: list[str], device: str = "cpu",
                   hf_configs: list[str] | None = None) -> int:
    """Run the conformance suite on one installed backend (``[FAMILY:]NAME``) on ``device``."""
    from lmplug.families import FAMILIES
    from lmplug.testing.runner import check, parse_options

    family, _, backend = name.rpartition(":")
    families = [family] if family else [f for f in FAMILIES if backend in registry.backends(f)]
    if len(families) != 1:
        where = ", ".join(f"{f}:{backend}" for f in families) if families else "none"
        raise LmplugError(f"--check {name!r}: expected one installed backend, found {where}; "
                          "name it as FAMILY:NAME (see `lmplug plugins`)")
    return check(families[0], backend, parse_options(options), [], device, hf_configs)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import yaml

    from lmplug.plugins import get_registry
    from lmplug.train_host import LLMTrainingHost

    options = {}
    for pair in args.option:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise LmplugError(f"-o {pair!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    info = get_registry().get("speculative", args.method)
    try:
        info.cls.train(LLMTrainingHost(), args.model, args.out, options)
    except NotImplementedError as exc:
        raise LmplugError(str(exc)) from None
    return 0


def _build_kernels() -> None:
    """Compile the CPU kernels at pull, so that the first run does not (the plugins declare theirs
    when their families register)."""
    from lmplug.engine.build import build_cpu_kernels
    from lmplug.kit import fused_cpu  # noqa: F401  (declares the core's kernel)
    from lmplug.plugins import get_registry

    registry = get_registry()
    for family in ("attention", "quant"):  # importing a family's backends declares its kernels
        registry.backends(family)
    build_cpu_kernels()


def cmd_models(args: argparse.Namespace) -> int:
    from lmplug.loading import cache

    if args.action == "pull":
        path = cache.pull(args.name)
        _build_kernels()
        print(path)
    else:
        models = cache.list_models()
        if not models:
            print(f"no models in {cache.cache_dir()}; try: lmplug models pull smollm2-135m-instruct")
        for name, path, size in models:
            print(f"{name:<28} {size / 1e6:8.1f} MB  {path}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from lmplug.quantize import run_quantize

    return run_quantize(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from lmplug.evaluate import run_eval

    return run_eval(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from lmplug.bench import run_bench

    return run_bench(args, _overrides(args))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmplug", description="An LLM inference engine in which every "
                                "optimization is a plugin.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    p.add_argument("--version", action="version", version=f"%(prog)s {version_text()}")
    sub = p.add_subparsers(metavar="COMMAND", parser_class=CommandParser)

    g = sub.add_parser("generate", help="generate text for prompts (streams to stdout)")
    g.add_argument("prompt", nargs="*", help="prompts (default: read one from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--stats", action="store_true", help="print load time, TTFT, TPOT and tokens/s (and, with "
                   "speculative decoding, drafted / accepted tokens and target forwards) to stderr")
    engine_args(g)
    sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming tokens")
    c.add_argument("--system", help="system prompt")
    engine_args(c)
    sampling_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    add_serve_arguments(s)
    engine_args(s, model_positional=True)
    s.set_defaults(func=cmd_serve)

    pl = sub.add_parser("plugins", help="list installed backends: family, name, distribution, capabilities")
    pl.add_argument("--check", metavar="[FAMILY:]NAME", help="run the conformance suite on this backend")
    pl.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a backend option for --check (repeatable)")
    pl.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where --check runs the backend (default: cpu; cuda: compiled kernels on a GPU)")
    pl.add_argument("--hf-config", action="append", default=[], metavar="PATH",
                    help="a config.json for --check model:NAME (repeatable): the kit builds a tiny "
                         "random model of it with transformers")
    pl.set_defaults(func=cmd_plugins)

    t = sub.add_parser("train-drafter", help="train a drafter's weights (e.g. Medusa heads) on text the "
                                             "model generates itself, and save them in the published format")
    t.add_argument("--method", required=True, help="drafter name, e.g. medusa")
    t.add_argument("model", help="the target: model name in the cache, HF folder, or .gguf file")
    t.add_argument("out", help="output folder")
    t.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a training option, e.g. num_heads=3, epochs=2, num_prompts=48 (repeatable)")
    t.set_defaults(func=cmd_train_drafter)

    m = sub.add_parser("models", help="the model cache ($LMPLUG_CACHE or ~/.cache/lmplug)")
    m.add_argument("action", choices=["pull", "list"])
    m.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    m.set_defaults(func=cmd_models)

    q = sub.add_parser("quantize", help="quantize a float model offline (gptq, awq, smoothquant, fp8, rtn) "
                                        "into a folder in a published format", arguments_from="lmplug.quantize")
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser("eval", help="perplexity over a text file, and KL divergence against a reference model",
                       arguments_from="lmplug.evaluate")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="batch-1 decode tokens/s, TTFT and load time (optionally vs HF transformers); "
                       "`lmplug bench serve --help`: load-test running servers")
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--compare-hf", action="store_true", help="also run HF transformers on the same model")
    b.add_argument("--num-requests", type=int, default=0,
                   help="throughput mode: submit this many mixed-length requests at once and report "
                        "tokens/s and per-step engine statistics")
    engine_args(b)
    b.set_defaults(func=cmd_bench)
    return p


if __name__ == "__main__":
    sys.exit(main())
