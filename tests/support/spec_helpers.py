"""Speculative-decoding test helpers (not a test module): drafters with known behaviour,
engines built with them, and a chi-square check.

- ``test_oracle`` proposes the reference (non-speculative) continuation stored in
  ``REFERENCE`` for the sequence's prompt, deliberately wrong at every ``wrong_every``-th
  output position: acceptance is partial and rollbacks happen all the time.
- ``test_table`` samples each draft from ``TABLE[context]`` (a distribution over the
  vocabulary) with the request's generator and returns it as ``probs``: a draft
  distribution the test controls, for exactness checks of speculative sampling.
"""

from __future__ import annotations

import types

import torch
from pydantic import Field

from lmplug import hookimpl
from lmplug.api import Capabilities, Drafter, DrafterOptions, DraftProposal
from lmplug.config import EngineConfig, resolve
from lmplug.engine.engine import LLMEngine
from lmplug.kit.sampling import draw
from lmplug.plugins import API_VERSION, Registry
from support.hf_models import prompt_ids

REFERENCE: dict[tuple[int, ...], list[int]] = {}  # prompt -> reference output tokens
TABLE: dict[tuple[int, ...], torch.Tensor] = {}  # context -> draft distribution [V]


class OracleOptions(DrafterOptions):
    wrong_every: int = Field(default=3, ge=0, description="0: always right")


class OracleDrafter(Drafter):
    name = "test_oracle"
    capabilities = Capabilities(devices=frozenset({"cpu"}))
    Options = OracleOptions

    def setup(self, target) -> None:
        self.vocab = target.model_config.vocab_size

    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        every = self.options.wrong_every
        out = []
        for seq in seqs:
            pos = seq.num_output_tokens
            ref = REFERENCE.get(tuple(seq.prompt_token_ids), [])[pos:pos + num_tokens]
            out.append([(t + 1) % self.vocab if every and (pos + j) % every == every - 1 else t
                        for j, t in enumerate(ref)])
        return DraftProposal(out)


class TableDrafter(Drafter):
    name = "test_table"
    capabilities = Capabilities(devices=frozenset({"cpu"}))

    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        ids, probs = [], []
        for seq in seqs:
            tokens, rows = [], []
            while len(tokens) < num_tokens and (q := TABLE.get(tuple(seq.token_ids + tokens))) is not None:
                tokens.append(draw(q, seq.generator))
                rows.append(q)
            ids.append(tokens)
            probs.append(torch.stack(rows) if rows else None)
        return DraftProposal(ids, probs)


def registry() -> Registry:
    """The first-party plugins plus the test drafters."""
    reg = Registry()
    plugin = types.ModuleType("spec_test_drafters")
    plugin.LMPLUG_API_VERSION = API_VERSION
    plugin.lmplug_register_speculative_methods = hookimpl(lambda: [OracleDrafter, TableDrafter])
    reg.register(plugin, name="spec_test_drafters")
    return reg


def make_engine(path, speculative: dict | None = None, **overrides) -> LLMEngine:
    """An engine over the test drafters. ``draft_length`` is ``fixed`` unless ``speculative``
    names it: these tests count drafts and steps, which the ``cost`` controller (its choices
    follow measured forward times) would make depend on the machine's load."""
    if speculative is not None and "draft_length" not in speculative:
        speculative = {**speculative, "draft_length": "fixed"}
    reg = registry()
    cfg = EngineConfig.from_dict({"model": str(path), "device": "cpu", "dtype": "float32",
                                  "max_model_len": 256, "speculative": speculative, **overrides})
    return LLMEngine(resolve(cfg, device="cpu", dtype="float32", registry=reg), reg)


def record_reference(path, prompts: list[list[int]], params) -> list[list[int]]:
    """Plain decoding's tokens for ``prompts`` (no drafter), kept in ``REFERENCE`` for the oracle."""
    outs = run(make_engine(path), prompts, params)
    for prompt, out in zip(prompts, outs):
        REFERENCE[tuple(prompt)] = out.token_ids
    return [o.token_ids for o in outs]


def run(engine: LLMEngine, prompts: list[list[int]], params, max_steps: int = 10_000) -> list:
    """Generate to completion (or fail after ``max_steps`` steps); outputs in prompt order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, p)
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    else:
        raise AssertionError(f"requests unfinished after {max_steps} steps")
    return [done[f"r{i}"] for i in range(len(prompts))]


# the chi-square tests of speculative sampling: a short seeded continuation of one prompt
SAMPLING = {"temperature": 0.8, "top_k": 3, "max_tokens": 3, "ignore_eos": True}
STAT_PROMPT = prompt_ids(6, 21)


def target_probs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' next-token distribution after ``ids`` under ``SAMPLING``'s filters, float64."""
    from lmplug.interfaces.params import SamplingParams
    from lmplug.kit.sampling import processed_logits

    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1:]
    return processed_logits(logits, [SamplingParams(**SAMPLING)]).softmax(-1)[0].double()


def pair_distribution(hf) -> dict[tuple[int, int], float]:
    """P(first two output tokens of ``STAT_PROMPT`` under ``SAMPLING``) from transformers."""
    p1 = target_probs(hf, STAT_PROMPT)
    expected = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = target_probs(hf, STAT_PROMPT + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            expected[(t1, t2)] = float(p1[t1] * p2[t2])
    return expected


def pair_counts(engine: LLMEngine, expected: dict, num: int,
                accepted: tuple[float, float] = (0.05, 0.95)) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first two output tokens of ``num`` seeded ``SAMPLING`` runs of ``STAT_PROMPT``
    over the categories of ``expected`` (+ one for pairs outside it), and their probabilities.
    Every request must draft once and the acceptance rate lie within ``accepted``, so both the
    accept and the reject path are exercised."""
    from lmplug.interfaces.params import SamplingParams

    outs = run(engine, [STAT_PROMPT] * num, [SamplingParams(**SAMPLING, seed=s) for s in range(num)])
    assert engine.speculator.num_drafted == num  # one draft per request (max_tokens=3)
    low, high = accepted
    assert low < engine.speculator.num_accepted / num < high
    keys = list(expected)
    counts = torch.zeros(len(keys) + 1)
    for o in outs:
        pair = tuple(o.token_ids[:2])
        counts[keys.index(pair) if pair in expected else -1] += 1
    return counts, torch.tensor([expected[k] for k in keys] + [0.0])


def check_observed_hidden(engine: LLMEngine, prompts: list[list[int]], params) -> int:
    """Run ``prompts``; after every step the (Medusa) drafter must hold, per running sequence, the
    target's hidden state at the position whose logits chose its last token, as a fresh prefill
    computes it. Returns how many states were checked."""
    from lmplug.train_host import hidden_states

    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    drafter, checked = engine.speculator.drafter, 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            hidden, num_tokens = drafter._hidden[seq.seq_id]
            assert num_tokens == seq.num_tokens
            expected = hidden_states(engine, seq.token_ids[:-1])[-1]
            torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
            checked += 1
    return checked


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of ``counts`` to ``probs`` (categories with p > 0)."""
    keep = probs > 0
    if (counts[~keep] > 0).any():
        return 0.0  # a sample the distribution cannot produce
    n = counts.sum()
    expected = probs[keep].double() * n
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


class TokenFeatures:
    """Stands in for a drafter's store of the target's features (EAGLE's features, DFlash's
    context) in the conformance suite, whose fake target computes none: the feature at position t
    is a fixed function of (token t, t) — deterministic, as the suite requires, and different at
    every position, so a drafter's state that goes stale shows."""

    def __init__(self, embed: torch.nn.Module) -> None:
        self.embed = embed

    def read(self, seq, start: int, end: int) -> torch.Tensor:
        ids = torch.tensor(seq.token_ids[start:end])
        return torch.tanh(3 * self.embed(ids) + torch.arange(start, end)[:, None] / 7)


def drafter_on_token_features(path, backend_class, options: dict):
    """A drafter set up on the tiny model at ``path`` (as the engine sets it up), its feature
    store replaced by ``TokenFeatures``: for the drafter conformance suite."""
    from lmplug.engine.draft_parts import draft_target

    parts = make_engine(path).parts
    drafter = backend_class(backend_class.Options(**options))
    drafter.setup(draft_target(parts.model, parts.model_config, parts.kv, parts.tokenizer,
                               torch.device("cpu"), torch.float32, parts.max_model_len, 8,
                               parts.model.layers[0].self_attn.backend))
    drafter.store.close()
    drafter.store = TokenFeatures(parts.model.embed_tokens)
    return drafter
