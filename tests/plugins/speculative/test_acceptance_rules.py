"""Acceptance rules: exact, typical (Medusa), cascade (speculative cascades) and route.

The conformance suite runs on every first-party rule (well-formed verdicts, seeded determinism,
each rule's tokens following its declared law by chi-square, exact's following p). Here, each
lossy rule against a direct implementation of its published formula, written again in this file:
typical's acceptance condition, the cascade's emitted mixture pi (chi-square against pi computed
here, which is not p), route's confidence test. Then the config (options validated, errors
naming the option), and the engine: a tiny model with the layer_skip drafter under each rule
reports the rule in the request metrics; a request with ``exact=True`` is refused under a lossy
rule and served under exact.
"""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
from lmplug_speculative.acceptance import CascadeRule, RouteRule, TypicalRule
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import chi_square_pvalue, make_engine, run

from lmplug.errors import ConfigError
from lmplug.kit.sampling import draw
from lmplug.testing import AcceptanceConformance

ALPHA = 1e-3


class TestExact(AcceptanceConformance):
    backend = "exact"


class TestTypical(AcceptanceConformance):
    backend = "typical"
    options: ClassVar[dict] = {"posterior_threshold": 0.25, "posterior_alpha": 0.5}


class TestCascadeOpt(AcceptanceConformance):
    backend = "cascade"
    options: ClassVar[dict] = {"deferral": "opt", "alpha": 0.5}


class TestCascadeChow(AcceptanceConformance):
    backend = "cascade"
    options: ClassVar[dict] = {"deferral": "chow", "alpha": 0.6}


class TestRoute(AcceptanceConformance):
    backend = "route"
    options: ClassVar[dict] = {"threshold": 0.35}


def chain(k: int, seed: int, vocab: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(k + 1, vocab, generator=g, dtype=torch.float64)
    q = (logits[:k] + 1.5 * torch.randn(k, vocab, generator=g, dtype=torch.float64)).softmax(-1)
    return logits.softmax(-1), q


# -- typical ------------------------------------------------------------------------------------
def medusa_accepts(p_row: list[float], token: int, epsilon: float, delta: float) -> bool:
    """Medusa's typical acceptance, from the paper: p(x) > min(epsilon, delta * exp(-H(p)))."""
    entropy = -sum(v * math.log(v) for v in p_row if v > 0)
    return p_row[token] > min(epsilon, delta * math.exp(-entropy))


@pytest.mark.parametrize("epsilon,delta", [(0.09, 0.3), (0.3, 0.55), (0.02, 0.9)])
def test_typical_accepts_by_the_published_condition(epsilon, delta):
    rule = TypicalRule(TypicalRule.Options(posterior_threshold=epsilon, posterior_alpha=delta))
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for seed in range(200):
        p, q = chain(4, seed)
        draft = [draw(q[j], gen) for j in range(4)]
        expected = 0
        while expected < 4 and medusa_accepts(p[expected].tolist(), draft[expected], epsilon, delta):
            expected += 1
        m, _ = rule.accept(p, q, draft, gen)
        assert m == expected, f"seed {seed}: accepted {m}, the formula accepts {expected}"
        seen.add(m)
    assert len(seen) >= 3  # the cases exercise short and long runs


def test_typical_corrects_from_the_target():
    """After a rejection the emitted token is the target's draw, not a residual: a draft the
    threshold refuses at position 0 leaves a token distributed as p[0]."""
    p, _ = chain(1, 3)
    rule = TypicalRule(TypicalRule.Options(posterior_threshold=0.9, posterior_alpha=1.0))
    gen = torch.Generator().manual_seed(1)
    worst = int(p[0].argmin())
    counts = torch.zeros(8)
    for _ in range(5000):
        m, tokens = rule.accept(p, None, [worst], gen)
        assert m == 0
        counts[tokens[0]] += 1
    assert chi_square_pvalue(counts, p[0]) > ALPHA


# -- cascade ------------------------------------------------------------------------------------
def opt_mixture(p_row: torch.Tensor, q_row: torch.Tensor, alpha: float) -> torch.Tensor:
    """The speculative cascade's target with the OPT deferral: defer (pi = p) iff
    max q < max p - alpha * TV(p, q); else pi = q."""
    tv = 0.5 * float((p_row - q_row).abs().sum())
    return p_row if float(q_row.max()) < float(p_row.max()) - alpha * tv else q_row


def test_cascade_emits_the_mixture():
    """Drafts from q, verified by the cascade: the first token follows pi (here pi = q, which
    differs from p by far more than the test resolves), and the second follows pi at position 1."""
    rule = CascadeRule(CascadeRule.Options(deferral="opt", alpha=2.0))
    for seed in range(40):
        p, q = chain(2, seed)
        pi0, pi1 = opt_mixture(p[0], q[0], 2.0), opt_mixture(p[1], q[1], 2.0)
        if torch.equal(pi0, q[0]) and float((p[0] - q[0]).abs().sum()) > 0.4:
            break
    else:
        raise AssertionError("no case where the cascade keeps the drafter")
    gen = torch.Generator().manual_seed(2)
    first, second = torch.zeros(8), torch.zeros(8)
    for _ in range(6000):
        m, tokens = rule.accept(p, q, [draw(q[0], gen), draw(q[1], gen)], gen)
        first[tokens[0]] += 1
        if m >= 1:
            second[tokens[1]] += 1
    assert chi_square_pvalue(first, pi0) > ALPHA
    assert chi_square_pvalue(first, p[0]) < ALPHA  # and it is not the target's distribution
    assert chi_square_pvalue(second, pi1) > ALPHA


def test_cascade_deferring_everywhere_is_exact():
    """alpha 0 with Chow's rule defers whenever max q < 1: pi = p, speculative sampling."""
    rule = CascadeRule(CascadeRule.Options(deferral="chow", alpha=0.0))
    p, q = chain(2, 5)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(8)
    for _ in range(6000):
        counts[rule.accept(p, q, [draw(q[0], gen), draw(q[1], gen)], gen).tokens[0]] += 1
    assert chi_square_pvalue(counts, p[0]) > ALPHA


def test_cascade_never_emits_what_the_target_rules_out():
    rule = CascadeRule(CascadeRule.Options(deferral="chow", alpha=1.0))  # never defers
    p, q = chain(2, 6)
    p[:, :4] = 0
    p = p / p.sum(-1, keepdim=True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(500):
        _, tokens = rule.accept(p, q, [draw(q[0], gen), draw(q[1], gen)], gen)
        assert all(t >= 4 for t in tokens)


# -- route --------------------------------------------------------------------------------------
def test_route_accepts_confident_drafts_only():
    rule = RouteRule(RouteRule.Options(threshold=0.7))
    vocab = 5
    p = torch.full((4, vocab), 1 / vocab, dtype=torch.float64)
    p[:, 1] = 0.01  # the target dislikes token 1 (yet never refuses it)
    p = p / p.sum(-1, keepdim=True)
    confident, unsure = torch.full((vocab,), 0.05, dtype=torch.float64), torch.full((vocab,), 0.2, dtype=torch.float64)
    confident[1] = 0.8
    gen = torch.Generator().manual_seed(5)
    q = torch.stack([confident, confident, unsure])
    for _ in range(50):
        m, tokens = rule.accept(p, q, [1, 1, 1], gen)
        assert m == 2 and tokens[:2] == [1, 1]  # p never consulted for confident drafts
    m, _ = rule.accept(p, torch.stack([unsure, confident, confident]), [1, 1, 1], gen)
    assert m == 0  # the first unconfident position ends the step; later ones are not reached
    assert rule.accept(p, None, [1, 1, 1], gen).num_accepted == 0  # no q: confidence unknown


# -- config -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("acceptance"), tokenizer=True)


@pytest.mark.parametrize("acceptance,needle", [
    ({"rule": "typical", "posterior_threshold": 2}, "speculative.acceptance.posterior_threshold"),
    ({"rule": "cascade", "deferral": "chow", "alpha": 3}, "speculative.acceptance.alpha"),
    ({"rule": "route", "threshold": 0}, "speculative.acceptance.threshold"),
    ({"rule": "typical", "bogus": 1}, "speculative.acceptance.bogus: unknown option"),
    ({"rule": "nope"}, "nope"),
    ({"posterior_threshold": 0.1}, "missing `rule`"),
    (7, "speculative.acceptance: expected"),
])
def test_bad_acceptance_config_names_the_option(model, acceptance, needle):
    with pytest.raises(ConfigError, match="speculative.acceptance") as err:
        make_engine(model.path, {"method": "ngram", "num_tokens": 3, "acceptance": acceptance})
    assert needle in str(err.value)


# -- the engine ---------------------------------------------------------------------------------
SAMPLED = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, "seed": 11}
LAYER_SKIP = {"method": "layer_skip", "num_tokens": 3, "num_layers": 1}


@pytest.mark.parametrize("acceptance", [
    "typical", {"rule": "cascade", "deferral": "chow", "alpha": 1.0}, {"rule": "route", "threshold": 1e-6}])
def test_lossy_rules_run_and_say_so(model, acceptance):
    """(cascade and route set to keep the drafter everywhere: the tiny model's distributions are
    nearly flat, and this test is about the wiring; the rules' math is tested above)"""
    from lmplug.interfaces.params import SamplingParams

    engine = make_engine(model.path, {**LAYER_SKIP, "acceptance": acceptance})
    name = acceptance if isinstance(acceptance, str) else acceptance["rule"]
    outs = run(engine, [prompt_ids(6, 1), prompt_ids(9, 2)], SamplingParams(**SAMPLED))
    for out in outs:
        assert len(out.token_ids) == 12
        assert (out.metrics.acceptance_rule, out.metrics.lossy) == (name, True)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # the rule did accept drafts
    with pytest.raises(ConfigError, match=rf"exact=True.*lossy acceptance rule '{name}'"):
        engine.add_request("strict", prompt_ids(5, 3), SamplingParams(**SAMPLED, exact=True))


def test_exact_requests_are_served_under_exact(model):
    from lmplug.interfaces.params import SamplingParams

    for speculative in (LAYER_SKIP, {**LAYER_SKIP, "acceptance": "exact"}):
        engine = make_engine(model.path, speculative)
        out = run(engine, [prompt_ids(6, 1)], SamplingParams(**SAMPLED, exact=True))[0]
        assert len(out.token_ids) == 12
        assert (out.metrics.acceptance_rule, out.metrics.lossy) == ("exact", False)
    with pytest.raises(ConfigError, match="SamplingParams.exact"):
        SamplingParams(exact="yes")


def test_the_server_reports_the_rule_and_refuses_exact_requests_under_a_lossy_one(model):
    """The HTTP response's usage names the rule and says it is lossy; a request with ``exact:
    true`` gets a 400 naming the rule, before any token."""
    import httpx
    from support.serve_util import running_server

    from lmplug import LLM

    llm = LLM(str(model.path), device="cpu", dtype="float32", max_model_len=256,
              speculative={**LAYER_SKIP, "acceptance": "typical", "draft_length": "fixed"})
    body = {"model": str(model.path), "prompt": prompt_ids(6, 1), "max_tokens": 12, "temperature": 1.0,
            "seed": 3, "ignore_eos": True}
    with running_server(llm) as srv:
        reply = httpx.post(srv.v1 + "/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        spec = reply.json()["usage"]["speculative"]
        assert (spec["acceptance_rule"], spec["lossy"]) == ("typical", True)
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"] and spec["drafted_tokens"] > 0
        refused = httpx.post(srv.v1 + "/completions", json={**body, "exact": True}, timeout=60)
        assert refused.status_code == 400 and "typical" in refused.text, refused.text
