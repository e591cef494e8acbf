"""``lmplug eval MODEL --text FILE``: perplexity, and KL divergence against a reference model.

The text is tokenized once (no special tokens) and scored with sliding
windows of ``window`` tokens advancing by ``stride``: every token after the
first is predicted exactly once, by the window that first holds it, from up
to ``window - 1`` tokens of context (the first window scores all its
tokens; later ones only those past the previous window's end). Both models
run through lmplug's engine (model + quant method as configured), and every
number is computed in float64 from ``log_softmax`` of the logits:

- perplexity = ``exp(mean NLL)`` of the scored tokens under MODEL;
- KL = mean over the same positions of ``KL(P_ref || P_model) =
  Σ_v p_ref(v) (log p_ref(v) - log p_model(v))``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from lmplug.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model name in the cache, HF folder (e.g. a quantized one), or .gguf file")
    p.add_argument("--text", required=True, help="UTF-8 text file to score (held-out text)")
    p.add_argument("--reference", help="reference model for the KL divergence (default: none)")
    p.add_argument("--quant", help="quant method to load MODEL with (default: the checkpoint's own format)")
    p.add_argument("--quant-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of MODEL's quant method (repeatable; e.g. dequantize_at_load=true)")
    p.add_argument("--reference-quant", help="quant method to load --reference with")
    p.add_argument("--reference-quant-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the reference's quant method (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, help="score at most the first N tokens of the text")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--stride", type=int, help="tokens a window advances (default: window / 2)")


class Scorer:
    """One model in an lmplug engine; ``log_probs`` runs one sequence's prefill and returns the
    next-token log-probabilities (float64) of the rows asked for."""

    def __init__(self, model: str, *, window: int, dtype: str = "float32", quant: str | None = None,
                 quant_options: dict | None = None) -> None:
        from lmplug.llm import LLM

        overrides: dict = {"dtype": dtype, "device": "cpu", "max_model_len": window + 1,
                           "scheduler": {"backend": "auto", "max_num_seqs": 1,
                                         "max_num_batched_tokens": max(window + 1, 16)}}
        if quant_options and not quant:
            raise ConfigError("quant options need the quant method they belong to (--quant / --reference-quant)")
        if quant:
            overrides["quant"] = {"method": quant, **(quant_options or {})}
        self.llm = LLM(model, **overrides)
        self.engine = self.llm.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @torch.inference_mode()
    def log_probs(self, ids: list[int], rows: range) -> torch.Tensor:
        from lmplug.interfaces.params import SamplingParams
        from lmplug.interfaces.scheduler import ScheduledSeq
        from lmplug.interfaces.sequence import Sequence

        engine = self.engine
        seq = Sequence("eval", ids, SamplingParams(max_tokens=1))
        engine.kv.allocate(seq, len(ids))
        try:
            input_ids, ctx = engine.runner.build_context([ScheduledSeq(seq, len(ids))])
            hidden = engine.parts.model(input_ids, ctx.positions, ctx)
            logits = engine.parts.model.compute_logits(hidden[rows.start:rows.stop])
        finally:
            engine.kv.free(seq)
        return torch.log_softmax(logits.double(), dim=-1)


def windows(num_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """``(begin, end, first_target)``: score targets ``first_target .. end - 1`` of window
    ``tokens[begin:end]``; every target ``1 .. num_tokens - 1`` exactly once."""
    prev_end = 1
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + window, num_tokens)
        if end > prev_end:
            yield begin, end, prev_end
            prev_end = end
        if end == num_tokens:
            return


def evaluate(model: Scorer, tokens: list[int], window: int, stride: int,
             reference: Scorer | None = None) -> dict:
    nll, kl, count = 0.0, 0.0, 0
    for begin, end, first in windows(len(tokens), window, stride):
        ids = tokens[begin:end]
        rows = range(first - 1 - begin, end - 1 - begin)  # logits at these rows predict the targets
        targets = torch.tensor(tokens[first:end])
        lp = model.log_probs(ids, rows)
        nll -= lp.gather(1, targets[:, None]).sum().item()
        if reference is not None:
            ref = reference.log_probs(ids, rows)
            kl += (ref.exp() * (ref - lp)).sum().item()
        count += len(targets)
    out = {"tokens_scored": count, "nll": nll / count, "perplexity": math.exp(nll / count)}
    if reference is not None:
        out["kl"] = kl / count
    return out


def run_eval(args: argparse.Namespace) -> int:
    text_path = Path(args.text)
    if not text_path.is_file():
        raise ConfigError(f"--text {args.text}: no such file")
    if args.window < 2:
        raise ConfigError(f"--window {args.window}: need at least 2 tokens")
    stride = args.stride or max(1, args.window // 2)
    if not 1 <= stride <= args.window - 1:
        raise ConfigError(f"--stride {stride}: must be between 1 and --window - 1 ({args.window - 1})")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ConfigError(f"--max-tokens {args.max_tokens}: need at least 2 tokens")
    model = Scorer(args.model, window=args.window, dtype=args.dtype, quant=args.quant,
                   quant_options=_options("--quant-option", args.quant_option))
    if model.tokenizer is None:
        raise ConfigError(f"{args.model}: the model has no tokenizer to tokenize --text with")
    tokens = model.tokenizer.encode(text_path.read_text(encoding="utf-8"), add_special_tokens=False)
    tokens = tokens[:args.max_tokens] if args.max_tokens else tokens
    if len(tokens) < 2:
        raise ConfigError(f"--text {args.text}: {len(tokens)} tokens; need at least 2 to score")
    reference = (Scorer(args.reference, window=args.window, quant=args.reference_quant,
                        quant_options=_options("--reference-quant-option", args.reference_quant_option))
                 if args.reference else None)
    result = evaluate(model, tokens, args.window, stride, reference)
    print(json.dumps({"model": args.model, "reference": args.reference, "window": args.window,
                      "stride": stride, **result}, indent=2))
    return 0


def _options(flag: str, items: list[str]) -> dict:
    """``KEY=VALUE`` strings -> a dict, each value read as YAML (``true``, ``4``, ``[a, b]``)."""
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            out[key] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"{flag} {item!r}: the value is not valid YAML; quote a plain string") from None
    return out
