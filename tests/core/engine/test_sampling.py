"""Sampling: parameter checks, greedy, seeds, the filters against HF's warpers, the sampled
distribution, stop conditions, ``n`` and streaming."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.hf_models import get_model, hf_greedy, one_torch_thread, prompt_ids  # noqa: F401

from lmplug import ConfigError, SamplingParams
from lmplug.interfaces.sequence import Sequence
from lmplug.kit.sampling import apply_filters, sample

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "hf_models"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny(models_root):
    """The tiny Llama with a tokenizer.json over its 512-token vocab."""
    return get_model("llama", models_root, tokenizer=True)


@pytest.fixture(scope="session")
def llm(tiny):
    return tiny.llm()


@pytest.fixture(scope="session")
def hf_tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.path)


@pytest.fixture(scope="session")
def full_run(llm):
    """32 greedy tokens for PROMPT with nothing stopping them: the baseline stops cut short."""
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]


# -- SamplingParams validation ---------------------------------------------------------------

BAD = [
    ("n", 0), ("n", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", "hot"), ("top_k", -2), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")), ("min_p", -0.01), ("min_p", 1.5),
    ("seed", "abc"), ("seed", 1.5), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("stop_token_ids", ["x"]), ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 21),
    ("prompt_logprobs", 1.0),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}" in str(info.value)


def test_good_sampling_params_accepted():
    SamplingParams(n=3, max_tokens=None, temperature=0, top_k=-1, top_p=1.0, min_p=1.0, seed=0,
                   stop="x", stop_token_ids=[0], logprobs=20, prompt_logprobs=0)
    assert SamplingParams(stop="ab").stop == ["ab"]


# -- greedy and seeds ----------------------------------------------------------------------

def test_temperature_zero_is_hf_greedy(tiny, llm):
    prompt = prompt_ids(12, seed=21)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, seed=3))[0]
    assert out.token_ids == hf_greedy(tiny.hf, prompt, 16)


def test_top_k_1_is_greedy(tiny, llm):
    prompt = prompt_ids(12, seed=22)
    out = llm.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(tiny.hf, prompt, 16)


def test_greedy_row_unaffected_by_sampled_rows(tiny, llm):
    prompts = [prompt_ids(12, seed=23), prompt_ids(9, seed=24), prompt_ids(5, seed=25)]
    params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, ignore_eos=True, seed=2)]
    outs = llm.generate(prompts, params)
    assert outs[1].token_ids == hf_greedy(tiny.hf, prompts[1], 16)


def _sampled(llm, prompt, seed, **kw):
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=seed, **kw)
    return llm.generate([prompt], sp)[0].token_ids


@pytest.mark.parametrize("filters", [{}, {"top_k": 20, "top_p": 0.9, "min_p": 0.02}])
def test_seeded_sampling_reproducible_and_batch_independent(llm, filters):
    prompt = prompt_ids(10, seed=26)
    alone = _sampled(llm, prompt, 1234, **filters)
    assert _sampled(llm, prompt, 1234, **filters) == alone
    others = [prompt_ids(7, seed=27), prompt_ids(15, seed=28), prompt_ids(4, seed=29)]
    params = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True),  # unseeded
              SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1234, **filters),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.3, top_k=5, max_tokens=24, ignore_eos=True, seed=99)]
    outs = llm.generate([others[0], prompt, others[1], others[2]], params)
    assert outs[1].token_ids == alone


def test_different_seeds_differ(llm):
    prompt = prompt_ids(10, seed=30)
    runs = {tuple(_sampled(llm, prompt, seed)) for seed in (1, 2, 3)}
    assert len(runs) == 3


# -- the filters against transformers' warpers ----------------------------------------------

def _hf_filter(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0:
        warpers.append(MinPLogitsWarper(min_p))
    scores = row.unsqueeze(0).clone()
    for w in warpers:
        scores = w(None, scores)
    return scores[0]


def test_apply_filters_matches_hf_warpers():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 4096, 96
    logits = torch.randn(rows, vocab, generator=g) * 3
    choice = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]
    temps = [choice([0.5, 0.8, 1.0, 1.7]) for _ in range(rows)]
    top_k = [choice([0, 0, 1, 7, 50, 4096, 5000]) for _ in range(rows)]
    top_p = [choice([1.0, 1.0, 0.95, 0.7, 0.3, 0.05]) for _ in range(rows)]
    min_p = [choice([0.0, 0.0, 0.01, 0.1, 0.5]) for _ in range(rows)]
    scaled = logits / torch.tensor(temps).unsqueeze(1)
    ours = apply_filters(scaled, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    for i in range(rows):
        ref = _hf_filter(logits[i], temps[i], top_k[i], top_p[i], min_p[i])
        kept, ref_kept = torch.isfinite(ours[i]), torch.isfinite(ref)
        assert torch.equal(kept, ref_kept), (
            f"row {i} (T={temps[i]}, top_k={top_k[i]}, top_p={top_p[i]}, min_p={min_p[i]}): "
            f"keeps {int(kept.sum())} tokens, HF keeps {int(ref_kept.sum())}")
        torch.testing.assert_close(ours[i][kept], ref[ref_kept], rtol=1e-6, atol=1e-6)


def test_filters_off_keep_every_token_in_a_mixed_batch():
    """A row with no filter shares the batch with filtered rows: it must keep its whole vocab,
    however small the tail probabilities (a cumulative sum over 32k floats passes 1.0)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 32000, generator=g) * 3
    out = apply_filters(logits, torch.tensor([5, 0, 0, 0]), torch.tensor([1.0, 1.0, 0.9, 1.0]),
                        torch.tensor([0.0, 0.0, 0.0, 0.1]))
    assert torch.isfinite(out[1]).all()


# -- the sampled distribution -------------------------------------------------------------------

# chi-square critical values at p = 1e-5 by degrees of freedom
CHI2_CRIT = {2: 23.03, 5: 30.86}


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    seqs = [Sequence("r", [1], params, generator=gen) for _ in range(n)]
    tokens = sample(logits.expand(n, -1), seqs)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token with probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_sampling_matches_softmax_over_temperature(temperature):
    logits = torch.tensor([[2.0, 1.2, 0.5, 0.0, -1.0, -2.5]])
    counts = _draw(logits, SamplingParams(temperature=temperature), 30000, seed=7)
    stat = _chi2(counts, (logits[0] / temperature).softmax(-1))
    assert stat < CHI2_CRIT[5], f"chi2 = {stat:.1f}"
    # power check: the same counts reject a neighbouring temperature
    wrong = _chi2(counts, (logits[0] / (temperature * 1.25)).softmax(-1))
    assert wrong > 3 * CHI2_CRIT[5], f"test cannot tell T={temperature} from T={temperature * 1.25}"


def test_sampling_with_top_k_renormalises():
    logits = torch.tensor([[2.0, 1.2, 0.5, 0.0, -1.0, -2.5]])
    counts = _draw(logits, SamplingParams(temperature=0.8, top_k=3), 20000, seed=8)
    probs = torch.zeros(6)
    probs[:3] = (logits[0, :3] / 0.8).softmax(-1)
    assert _chi2(counts, probs) < CHI2_CRIT[2]


# -- stop conditions (need the tokenizer) -------------------------------------------------------

def test_text_and_prompt_match_hf_tokenizer(full_run, hf_tok):
    assert full_run.prompt_token_ids == hf_tok(PROMPT).input_ids
    assert full_run.text == hf_tok.decode(full_run.token_ids, skip_special_tokens=True)
    assert len(full_run.text) > 20


def _stop_cases(full_run, hf_tok):
    """Stop strings: one that spans two tokens, one inside a single token, one at the start."""
    ids, text = full_run.token_ids, full_run.text
    pieces = [hf_tok.decode([t], skip_special_tokens=True) for t in ids]
    cases = {}
    for j, piece in enumerate(pieces):
        if j >= 3 and piece and j + 1 < len(pieces) and pieces[j + 1] and "span" not in cases:
            cases["span"] = piece[-1] + pieces[j + 1][:2]  # crosses the boundary after token j
        if j >= 3 and len(piece) >= 3 and "inside" not in cases:
            cases["inside"] = piece[1:-1]
    cases["first"] = text[:2]
    return cases


@pytest.mark.parametrize("case", ["span", "inside", "first"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string(llm, full_run, hf_tok, case, include):
    stop = _stop_cases(full_run, hf_tok).get(case)
    if stop is None:
        pytest.skip(f"the greedy text has no {case!r} candidate")
    at = full_run.text.find(stop)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                              stop=["never-in-this-text", stop],
                                              include_stop_str_in_output=include))[0]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.text == (full_run.text[:at + len(stop)] if include else full_run.text[:at])
    # generation ended at the first token whose text completes the stop string
    k = next(k for k in range(1, 33)
             if stop in hf_tok.decode(full_run.token_ids[:k], skip_special_tokens=True))
    assert out.token_ids == full_run.token_ids[:k]


def test_stop_token_ids(llm, full_run):
    ids = full_run.token_ids
    j = next(j for j in range(3, len(ids)) if ids[j] not in ids[:j])
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                              stop_token_ids=[ids[j]]))[0]
    assert out.token_ids == ids[:j + 1]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == ids[j]


def test_max_tokens_is_length(llm, full_run):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == full_run.token_ids[:5]
    assert out.finish_reason == "length"
    assert out.outputs[0].stop_reason is None


@pytest.fixture(scope="session")
def eos_model(tiny, models_root):
    """The same weights with EOS set to a token the greedy run emits at step 5."""
    prompt = prompt_ids(12, seed=40)
    ref = hf_greedy(tiny.hf, prompt, 32)
    j = next(j for j in range(5, 32) if ref[j] not in ref[:j])
    eos = ref[j]
    path = models_root / "llama_eos"
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(tiny.path, path, ignore=shutil.ignore_patterns("tokenizer*"))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = eos
        (path / name).write_text(json.dumps(cfg))
    from lmplug import LLM

    return LLM(str(path), dtype="float32", device="cpu", max_model_len=256), prompt, eos, j


def test_eos_stops_like_hf(tiny, eos_model):
    llm, prompt, eos, j = eos_model
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
    assert out.token_ids == hf_greedy(tiny.hf, prompt, 32, eos_token_id=eos)
    assert out.token_ids[-1] == eos and len(out.token_ids) == j + 1
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason is None


def test_ignore_eos_runs_to_max_tokens(tiny, eos_model):
    llm, prompt, eos, _j = eos_model
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(tiny.hf, prompt, 32)
    assert eos in out.token_ids
    assert out.finish_reason == "length"


# -- n and streaming ---------------------------------------------------------------------------

def test_n_returns_n_completions(llm):
    out = llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert all(c.text for c in out.outputs)


def test_n_with_greedy_gives_identical_completions(llm, full_run):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [full_run.token_ids] * 3


def _stream(llm, params):
    outs = list(llm.stream(PROMPT, params))
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs


def test_stream_deltas_add_up(llm, full_run):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = _stream(llm, params)
    assert len(outs) > 1
    assert "".join(o.delta_text for o in outs) == outs[-1].text == full_run.text
    assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids == full_run.token_ids


@pytest.mark.parametrize("case", ["span", "inside"])
def test_stream_deltas_add_up_with_stop_string(llm, full_run, hf_tok, case):
    """Text streamed before a stop string is recognised must not include part of it."""
    stop = _stop_cases(full_run, hf_tok).get(case)
    if stop is None:
        pytest.skip(f"the greedy text has no {case!r} candidate")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=stop)
    outs = _stream(llm, params)
    final = llm.generate(PROMPT, params)[0]
    assert outs[-1].text == final.text == full_run.text[:full_run.text.find(stop)]
    assert "".join(o.delta_text for o in outs) == final.text
    assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
