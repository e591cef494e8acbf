"""The logits-adjustment stage (``lmplug.kit.penalties``): repetition penalty, logit_bias
and min_tokens against transformers' own logits processors, presence / frequency penalties
against a plain per-token loop, the constraint bitmask against a bool mask; the parameter
checks; ``sample`` and ``verify_batch`` on the adjusted logits; and greedy ``LLM.generate``
with a repetition penalty against ``transformers``' ``generate``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from support.hf_models import get_model, hf_generate, one_torch_thread, prompt_ids  # noqa: F401
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from lmplug import ConfigError, SamplingParams
from lmplug.interfaces.constraint import new_bitmask
from lmplug.interfaces.params import check_token_ids
from lmplug.interfaces.sequence import Sequence
from lmplug.kit.penalties import NO_HISTORY, RowHistory, adjust_logits
from lmplug.kit.sampling import draw, processed_logits, sample
from lmplug.speculative.verifier import verify_batch

V = 97  # not a multiple of 32: the bitmask's last word is partial
EOS = frozenset({2, 5})


def random_case(n: int, seed: int) -> tuple[torch.Tensor, list[RowHistory]]:
    """Logits of both signs and histories with repeats (prompt and output overlap)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 4
    histories = []
    for _ in range(n):
        prompt = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, 40, (int(torch.randint(0, 25, (1,), generator=g)),), generator=g).tolist()
        histories.append(RowHistory(prompt, output))
    return logits, histories


def hf_ids(h: RowHistory) -> torch.Tensor:
    return torch.tensor([list(h.prompt_ids) + list(h.output_ids)], dtype=torch.long)


# -- SamplingParams ----------------------------------------------------------------------------

BAD = [("presence_penalty", 3), ("presence_penalty", -2.5), ("frequency_penalty", float("nan")),
       ("frequency_penalty", "1"), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
       ("repetition_penalty", 101), ("repetition_penalty", float("inf")), ("min_tokens", -1),
       ("min_tokens", 1.5), ("logit_bias", {5: 101}), ("logit_bias", {5: float("nan")}),
       ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", {"-3": 1.0}),
       ("logit_bias", {1.5: 1.0}), ("logit_bias", [(5, 1.0)]), ("logit_bias", {5: 1.0, "5": 2.0}),
       ("logit_bias", {"9" * 5000: 1.0}),
       ("logit_bias", {i: 1.0 for i in range(1025)})]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={str(v)[:20]}" for f, v in BAD])
def test_bad_adjustment_params_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


def test_adjustment_params_messages_and_conversion():
    with pytest.raises(ConfigError, match=r"presence_penalty=3 is invalid: expected a number in \[-2, 2\]"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ConfigError, match=r"min_tokens=9 is invalid: expected at most max_tokens \(8\)"):
        SamplingParams(max_tokens=8, min_tokens=9)
    SamplingParams(max_tokens=None, min_tokens=10_000)
    sp = SamplingParams(logit_bias={"17": 5, 3: -100}, presence_penalty=-2, frequency_penalty=2,
                        repetition_penalty=100)
    assert sp.logit_bias == {17: 5.0, 3: -100.0} and all(type(k) is int for k in sp.logit_bias)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams().needs_adjusting
    for kw in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 0.9},
               {"logit_bias": {1: 0.0}}, {"min_tokens": 1}):
        assert SamplingParams(**kw).needs_adjusting, kw


def test_check_token_ids_names_the_field():
    check_token_ids(SamplingParams(logit_bias={96: 1.0}, stop_token_ids=[96]), V)
    with pytest.raises(ConfigError, match=r"SamplingParams\.logit_bias has token id 97.*97 tokens"):
        check_token_ids(SamplingParams(logit_bias={"97": 1.0}), V)
    with pytest.raises(ConfigError, match=r"SamplingParams\.stop_token_ids has token id 500"):
        check_token_ids(SamplingParams(stop_token_ids=[3, 500]), V)


# -- each adjustment against its reference -----------------------------------------------------

def test_repetition_penalty_equals_transformers_batched():
    logits, histories = random_case(6, seed=1)
    penalties = [1.3, 1.0, 0.7, 1.0, 2.5, 1.05]  # rows 1 and 3: off
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    out = adjust_logits(logits, params, histories)
    for i, (p, h) in enumerate(zip(penalties, histories)):
        ref = RepetitionPenaltyLogitsProcessor(p)(hf_ids(h), logits[i:i + 1].clone()) if p != 1 else logits[i:i + 1]
        assert torch.equal(out[i:i + 1], ref), i
    assert not torch.equal(out[0], logits[0])


def test_presence_and_frequency_penalties_equal_a_per_token_loop():
    logits, histories = random_case(5, seed=2)
    pairs = [(0.5, 0.0), (0.0, 0.0), (-1.5, 2.0), (0.0, -0.7), (2.0, 1.25)]  # (presence, frequency)
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in pairs]
    out = adjust_logits(logits, params, histories)
    ref = logits.clone()
    for i, ((presence, frequency), h) in enumerate(zip(pairs, histories)):
        for token, count in Counter(h.output_ids).items():  # the output only, never the prompt
            ref[i, token] -= torch.tensor(frequency) * count
            ref[i, token] -= torch.tensor(presence)
    assert torch.equal(out, ref)
    prompt_only = set(histories[0].prompt_ids) - set(histories[0].output_ids)
    assert all(out[0, t] == logits[0, t] for t in prompt_only)


def test_logit_bias_equals_transformers_sequence_bias():
    logits, histories = random_case(4, seed=3)
    biases = [{0: 100.0, 96: -100.0, 40: 3.5}, None, {7: -0.25}, {}]
    params = [SamplingParams(logit_bias=b) for b in biases]
    out = adjust_logits(logits, params, histories)
    for i, b in enumerate(biases):
        ref = logits[i:i + 1]
        if b:
            ref = SequenceBiasLogitsProcessor([[[t], v] for t, v in b.items()])(hf_ids(histories[i]), ref.clone())
        assert torch.equal(out[i:i + 1], ref), i


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_eos_and_stop_ids_until_reached(ignore_eos):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    prompt = list(range(10, 20))
    sp = SamplingParams(min_tokens=3, stop_token_ids=[7, 2], ignore_eos=ignore_eos)
    histories = [RowHistory(prompt, [30] * k) for k in (0, 2, 3)]  # rows: 0, 2 and 3 tokens out
    out = adjust_logits(logits, [sp] * 3, histories, eos_token_ids=EOS)
    hf = MinNewTokensLengthLogitsProcessor(len(prompt), 3, sorted(EOS | {7}))
    for i in range(3):
        expected = hf(hf_ids(histories[i]), logits[i:i + 1].clone())
        if ignore_eos:  # EOS ends nothing, so only the stop ids (7 and 2) stay blocked
            expected[0, 5] = logits[i, 5]
        assert torch.equal(out[i:i + 1], expected), i
    assert torch.equal(out[2], logits[2])  # reached: nothing blocked
    assert out[0, 7] == out[1, 2] == float("-inf")


def test_all_adjustments_in_order_equal_the_processors_chained():
    logits, histories = random_case(4, seed=5)
    seen0, seen2 = histories[0].prompt_ids[0], histories[2].prompt_ids[0]  # biased and penalised: order shows
    params = [SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.6,
                             logit_bias={seen0: 4.0, 11: -2.0}, min_tokens=50, max_tokens=64),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, logit_bias={str(seen2): 1.5}),
              SamplingParams(frequency_penalty=-1.0, min_tokens=1)]
    out = adjust_logits(logits, params, histories, eos_token_ids=EOS)
    for i, (sp, h) in enumerate(zip(params, histories)):
        ids, ref = hf_ids(h), logits[i:i + 1].clone()
        if sp.repetition_penalty != 1:
            ref = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, ref)
        for token, count in Counter(h.output_ids).items():
            ref[0, token] -= torch.tensor(sp.frequency_penalty) * count
            ref[0, token] -= torch.tensor(sp.presence_penalty)
        if sp.logit_bias:
            ref = SequenceBiasLogitsProcessor([[[t], v] for t, v in sp.logit_bias.items()])(ids, ref)
        if sp.min_tokens:
            ref = MinNewTokensLengthLogitsProcessor(len(h.prompt_ids), sp.min_tokens, sorted(EOS))(ids, ref)
        assert torch.equal(out[i:i + 1], ref), i


def test_input_untouched_and_nothing_to_do_costs_no_copy():
    logits, histories = random_case(3, seed=6)
    saved = logits.clone()
    out = adjust_logits(logits, [SamplingParams(repetition_penalty=2.0)] * 3, histories)
    assert torch.equal(logits, saved) and not torch.equal(out, saved)
    same = adjust_logits(logits, [SamplingParams()] * 3, [NO_HISTORY] * 3)
    assert same.data_ptr() == logits.data_ptr()
    assert adjust_logits(logits.half(), [SamplingParams()] * 3, [NO_HISTORY] * 3).dtype == torch.float32
    with pytest.raises(ValueError, match="3 logits rows need as many params and histories"):
        adjust_logits(logits, [SamplingParams()] * 2, [NO_HISTORY] * 3)


def test_logit_bias_past_the_logits_is_refused():
    with pytest.raises(ValueError, match="logit_bias has token id 97"):
        adjust_logits(torch.zeros(1, V), [SamplingParams(logit_bias={97: 1.0})], [NO_HISTORY])


# -- the constraint bitmask ---------------------------------------------------------------------

def bitmask_from_bool(allowed: torch.Tensor) -> torch.Tensor:
    """int32 words built bit by bit in Python (the layout: token t is bit t % 32 of word t // 32)."""
    rows, vocab = allowed.shape
    words = []
    for r in range(rows):
        row = []
        for w in range((vocab + 31) // 32):
            value = sum(1 << b for b in range(32) if w * 32 + b < vocab and allowed[r, w * 32 + b])
            row.append(value - (1 << 32) if value >= 1 << 31 else value)
        words.append(row)
    return torch.tensor(words, dtype=torch.int32)


def test_bitmask_equals_a_bool_mask_on_the_given_rows():
    logits, histories = random_case(5, seed=7)
    g = torch.Generator().manual_seed(8)
    allowed = torch.rand(2, V, generator=g) < 0.3
    allowed[:, 31] = allowed[:, 96] = True  # the top bit of a word (int32 sign) and the last token
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams(),
              SamplingParams(), SamplingParams()]
    out = adjust_logits(logits, params, histories, bitmask=bitmask_from_bool(allowed), bitmask_rows=[3, 1])
    ref = adjust_logits(logits, params, histories)
    ref[3] = ref[3].masked_fill(~allowed[0], float("-inf"))
    ref[1] = ref[1].masked_fill(~allowed[1], float("-inf"))
    assert torch.equal(out, ref)
    # no rows given: mask row i is logits row i
    full = torch.rand(5, V, generator=g) < 0.5
    out = adjust_logits(logits, [SamplingParams()] * 5, [NO_HISTORY] * 5, bitmask=bitmask_from_bool(full))
    assert torch.equal(out, logits.masked_fill(~full, float("-inf")))


def test_bitmask_narrower_than_the_logits_forbids_the_tail():
    logits = torch.randn(1, 70)
    out = adjust_logits(logits, [SamplingParams()], [NO_HISTORY], bitmask=new_bitmask(1, 40))  # 64 bits
    assert torch.equal(out[0, :64], logits[0, :64]) and bool((out[0, 64:] == float("-inf")).all())


def test_a_row_with_no_token_left_raises():
    nothing = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="constraint allows no token at this position"):
        adjust_logits(torch.randn(2, V), [SamplingParams()] * 2, [NO_HISTORY] * 2, bitmask=nothing,
                      bitmask_rows=[1])
    only_eos = torch.zeros(1, V, dtype=torch.bool)
    only_eos[0, 5] = True
    sp = SamplingParams(min_tokens=2)
    with pytest.raises(ValueError, match=r"no token at this position \(min_tokens=2 blocks EOS"):
        adjust_logits(torch.randn(1, V), [sp], [RowHistory([1], [3])], EOS, bitmask_from_bool(only_eos))
    out = adjust_logits(torch.randn(1, V), [sp], [RowHistory([1], [3, 4])], EOS, bitmask_from_bool(only_eos))
    assert int(out.argmax()) == 5


# -- sample() -----------------------------------------------------------------------------------

def seq(params: SamplingParams, prompt: list[int], output: list[int] = (), seed: int | None = None) -> Sequence:
    s = Sequence("r", prompt, params, generator=None if seed is None else torch.Generator().manual_seed(seed))
    s.token_ids.extend(output)
    return s


def test_greedy_sample_takes_the_argmax_of_the_adjusted_logits():
    logits = torch.zeros(3, V)
    logits[:, 40] = 2.0  # the raw argmax, repeated in rows 0 and 2's outputs
    logits[:, 41] = 1.9
    seqs = [seq(SamplingParams(temperature=0, repetition_penalty=1.3), [1, 2], [40]),
            seq(SamplingParams(temperature=0), [1, 2], [40]),
            seq(SamplingParams(temperature=0, frequency_penalty=0.05, logit_bias={50: 1.95}), [40], [40, 40])]
    assert sample(logits, seqs) == [41, 40, 50]
    assert sample(logits[1:2], seqs[1:2]) == [40]  # the plain fast path


def test_seeded_sampling_row_is_unchanged_by_penalised_and_masked_rows():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, V, generator=g)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=7, presence_penalty=1.5)
    alone = sample(logits[1:2], [seq(target, [3, 4], [8, 8, 9], seed=7)])
    allowed = torch.ones(1, V, dtype=torch.bool)
    allowed[0, :50] = False
    batch = [seq(SamplingParams(temperature=1.2, repetition_penalty=1.5, seed=1), [5], [6], seed=1),
             seq(target, [3, 4], [8, 8, 9], seed=7),
             seq(SamplingParams(temperature=0, min_tokens=4), [1], [])]
    tokens = sample(logits, batch, EOS, bitmask_from_bool(allowed), [2])
    assert tokens[1] == alone[0] and tokens[2] >= 50
    # and it is the draw from the adjusted distribution
    adjusted = adjust_logits(logits[1:2], [target], [RowHistory([3, 4], [8, 8, 9])])
    probs = processed_logits(adjusted, [target]).softmax(-1)[0]
    assert alone[0] == draw(probs, torch.Generator().manual_seed(7))


# -- verify_batch() -----------------------------------------------------------------------------

def test_greedy_verify_rejects_a_draft_token_the_mask_forbids():
    logits = torch.full((3, V), -1.0)
    logits[:, 10] = 3.0
    logits[:, 11] = 2.0
    greedy = SamplingParams(temperature=0)
    hist = [NO_HISTORY] * 3
    assert verify_batch(logits, [3], [greedy], [[10, 10]], [None], [None], histories=hist)[0].num_accepted == 2
    allowed = torch.ones(1, V, dtype=torch.bool)
    allowed[0, 10] = False  # forbidden at draft position 1 only
    verdict = verify_batch(logits, [3], [greedy], [[10, 10]], [None], [None], histories=hist,
                           bitmask=bitmask_from_bool(allowed), bitmask_rows=[1])[0]
    assert verdict.tokens == [10, 11] and verdict.num_accepted == 1


def test_verify_rows_see_the_draft_tokens_before_them():
    """Row j's history is output + draft[:j]: a repetition penalty there rejects a repeated draft."""
    logits = torch.zeros(3, V)
    logits[:, 20] = 2.0
    logits[:, 21] = 1.8
    sp = SamplingParams(temperature=0, repetition_penalty=1.2)
    prompt, output, draft = [1, 2], [3], [20, 20]
    histories = [RowHistory(prompt, output + draft[:j]) for j in range(3)]
    verdict = verify_batch(logits, [3], [sp], [draft], [None], [None], histories=histories)[0]
    assert verdict.tokens == [20, 21]
    with pytest.raises(ValueError, match="need one RowHistory per logits row"):
        verify_batch(logits, [3], [sp], [draft], [None], [None])


def test_sampling_verify_never_emits_a_masked_token():
    logits = torch.zeros(2, 8)
    logits[0, 3] = 4.0  # the draft token, likely under the raw target, forbidden by the mask
    allowed = torch.ones(2, 8, dtype=torch.bool)
    allowed[0, 3] = False
    sp = SamplingParams(temperature=1.0)
    firsts = set()
    for s in range(200):
        v = verify_batch(logits, [2], [sp], [[3]], [None], [torch.Generator().manual_seed(s)],
                         histories=[NO_HISTORY] * 2, bitmask=bitmask_from_bool(allowed))[0]
        firsts.add(v.tokens[0])
    assert 3 not in firsts and len(firsts) == 7


# -- end to end: LLM.generate against transformers' generate ----------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.getbasetemp() / "hf_models_penalties")


def test_greedy_generate_with_repetition_penalty_equals_transformers(tiny):
    prompt = prompt_ids(12, seed=51)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    out = tiny.llm().generate([prompt], sp)[0]
    ref = hf_generate(tiny.hf, prompt, 24, repetition_penalty=1.3)[0, len(prompt):].tolist()
    assert out.token_ids == ref
    plain = hf_generate(tiny.hf, prompt, 24)[0, len(prompt):].tolist()
    assert ref != plain  # the penalty changes this run, so the check above has teeth


def test_greedy_generate_with_min_tokens_equals_transformers(tiny, tmp_path):
    """EOS set to a token the greedy run emits at step j: with min_tokens past j, EOS is masked
    out of the argmax until then, as HF's ``min_new_tokens`` does (needs the engine to hand the
    model's EOS ids to ``sample``)."""
    import json
    import shutil

    from lmplug import LLM

    prompt = prompt_ids(12, seed=52)
    ref = hf_generate(tiny.hf, prompt, 32)[0, len(prompt):].tolist()
    j = next(j for j in range(3, 20) if ref[j] not in ref[:j])
    eos = ref[j]
    path = tmp_path / "llama_eos"
    shutil.copytree(tiny.path, path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = eos
        (path / name).write_text(json.dumps(cfg))
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, min_tokens=j + 4))[0]
    expected = hf_generate(tiny.hf, prompt, 32, eos_token_id=eos, min_new_tokens=j + 4)[0, len(prompt):]
    assert out.token_ids == expected.tolist()
    assert len(out.token_ids) > j + 1  # EOS at step j was blocked


def test_greedy_speculation_with_penalties_equals_plain_decoding(tiny):
    """Drafts that are right at some positions and wrong at others (the oracle drafter): every
    verified row is penalised over the output plus the drafts before it, so the result is
    exactly plain decoding's."""
    from support.spec_helpers import REFERENCE, make_engine, run

    prompts = [prompt_ids(9, seed=53), prompt_ids(21, seed=54) * 2]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2,
                            presence_penalty=0.4, frequency_penalty=0.3, logit_bias={7: 2.0})
    plain = [o.token_ids for o in run(make_engine(tiny.path), prompts, params)]
    for prompt, out in zip(prompts, plain):
        REFERENCE[tuple(prompt)] = out
    engine = make_engine(tiny.path, {"method": "test_oracle", "num_tokens": 3, "wrong_every": 3})
    assert [o.token_ids for o in run(engine, prompts, params)] == plain
    assert 0.2 < engine.speculator.num_accepted / engine.speculator.num_drafted < 0.9
    unpenalised = run(make_engine(tiny.path), prompts, SamplingParams(temperature=0, max_tokens=20,
                                                                      ignore_eos=True))
    assert [o.token_ids for o in unpenalised] != plain
