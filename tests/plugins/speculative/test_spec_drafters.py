"""The first-party drafters (``lmplug_speculative``): n-gram proposals on crafted sequences;
``draft_model`` with the target itself as the draft accepts everything; every drafter leaves
greedy outputs unchanged; all pass the conformance suite's drafter checks."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from lmplug_speculative.ngram import find_match, propose_ngram
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import make_engine, run

from lmplug.engine.draft_parts import draft_target
from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence
from lmplug.testing import DrafterConformance

# -- ngram ---------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_match():
    #        0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 9]  # "2 3" matched at 1
    assert propose_ngram(tokens, 3, 3, 3) == []  # "9 2 3" never seen before
    assert propose_ngram(tokens, 1, 2, 2) == [4]


def test_ngram_prefers_the_longest_then_the_most_recent_match():
    tokens = [7, 3, 1, 8, 8, 3, 2, 9, 9, 7, 3]
    assert propose_ngram(tokens, 2, 1, 1) == [2, 9]  # "3": the latest earlier 3 is at 5
    assert propose_ngram(tokens, 2, 1, 2) == [1, 8]  # "7 3" at 0 beats the shorter match


def test_ngram_continues_a_repeating_pattern():
    """The copy overlaps the tokens it produces, so a period shorter than k repeats."""
    assert propose_ngram([5, 1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]
    assert propose_ngram([4] * 6, 4, 1, 3) == [4, 4, 4, 4]


def test_ngram_adaptive_drafts_as_many_as_the_match_is_long():
    from lmplug_speculative.ngram import match_length

    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 4, 5]  # "4 5" matched at 3; 9 != 3 before it
    assert match_length(tokens, 3, 2, 8) == 2
    assert propose_ngram(tokens, 6, 2, 2, adaptive=True) == [6, 7]
    assert propose_ngram(tokens, 6, 2, 2) == [6, 7, 9, 4, 5, 6]
    copied = [1, 2, 3, 4, 5, 6, 7, 8, 0, 2, 3, 4, 5]  # "2 3 4 5" agrees 4 back
    assert match_length(copied, 3, 2, 8) == 4
    assert propose_ngram(copied, 6, 2, 2, adaptive=True) == [6, 7, 8, 0]
    assert match_length(copied, 3, 2, 3) == 3  # capped


def test_ngram_without_a_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []
    assert propose_ngram([1], 4, 1, 3) == []
    assert find_match(torch.tensor([1, 2, 1, 2]), 2) == 0


def test_ngram_options_are_checked(tmp_path):
    from lmplug_speculative.ngram import NgramOptions

    with pytest.raises(ValueError, match="min_n"):
        NgramOptions(min_n=3, max_n=2)


class TestNgramConformance(DrafterConformance):
    backend = "ngram"
    options: ClassVar[dict] = {"min_n": 1, "max_n": 3}


# -- model drafters on a tiny random Llama ---------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [prompt_ids(5, 31), prompt_ids(30, 32), [11, 12, 13, 14, 15] * 4]
PAGED = {"backend": "paged", "block_size": 8, "num_blocks": 100, "prefix_caching": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("drafters"), tokenizer=True)


@pytest.fixture(scope="module")
def reference(model):
    return [o.token_ids for o in run(make_engine(model.path), PROMPTS, GREEDY)]


def spec_config(model, method: str) -> dict:
    extra = {"draft_model": {"model": str(model.path)}, "layer_skip": {"num_layers": 1},
             "ngram": {"min_n": 1}}[method]
    return {"method": method, "num_tokens": 3, **extra}


@pytest.mark.parametrize("kvcache", [{}, PAGED], ids=["contiguous", "paged-prefix"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "layer_skip"])
def test_greedy_outputs_unchanged(model, reference, method, kvcache):
    engine = make_engine(model.path, spec_config(model, method), **({"kvcache": kvcache} if kvcache else {}))
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    assert engine.speculator.num_drafted > 0
    assert engine.kv.usage == 0


def test_draft_model_equal_to_the_target_is_always_accepted(model, reference):
    engine = make_engine(model.path, spec_config(model, "draft_model"))
    run(engine, PROMPTS, GREEDY)
    assert engine.speculator.num_accepted == engine.speculator.num_drafted > 0
    assert engine.last_stats["spec_acceptance_rate"] == 1.0


def test_draft_model_sampling_returns_its_distributions(model):
    """Sampling: q is the draft's filtered distribution; with the target as the draft, p/q is
    1 up to rounding, so nearly every draft is accepted (rows or filters out of step would not)."""
    engine = make_engine(model.path, spec_config(model, "draft_model"))
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=16, ignore_eos=True, seed=s)
              for s in range(len(PROMPTS))]
    run(engine, PROMPTS, params)
    assert engine.speculator.num_accepted >= 0.95 * engine.speculator.num_drafted > 0


def test_draft_model_needs_the_same_tokenizer(model, tmp_path_factory):
    other = get_model("qwen2", tmp_path_factory.mktemp("other"))  # no tokenizer: nothing to compare
    make_engine(model.path, {"method": "draft_model", "model": str(other.path)})
    from lmplug_speculative.draft_model import check_tokenizers

    class Shifted:
        def encode(self, text):
            return [t + 1 for t in model.llm().tokenizer.encode(text)]

    with pytest.raises(ConfigError, match="tokenizes text differently"):
        check_tokenizers(model.llm().tokenizer, Shifted(), "shifted")


@pytest.mark.parametrize("method", ["draft_model", "layer_skip"])
def test_draft_cache_follows_changed_tokens(model, method):
    """The draft keeps K/V only up to the tokens it still shares with the sequence."""
    def decode_seq(tokens):
        seq = Sequence("a", tokens, GREEDY)
        seq.num_computed_tokens = seq.num_tokens - 1
        return seq

    drafter = make_engine(model.path, spec_config(model, method)).speculator.drafter
    seq = decode_seq(PROMPTS[1])
    drafter.propose([seq], 3)
    seq.token_ids[-4:] = [20, 21, 22, 23]  # not a rejection: tokens the draft computed change
    fresh = make_engine(model.path, spec_config(model, method)).speculator.drafter
    assert drafter.propose([seq], 3).token_ids == fresh.propose([decode_seq(seq.token_ids)], 3).token_ids


def test_layer_skip_checks_its_layer_count(model):
    with pytest.raises(ConfigError, match="num_layers=2 must be below"):
        make_engine(model.path, {"method": "layer_skip", "num_layers": 2})


class _ModelDrafterConformance(DrafterConformance):
    """Builds the drafter against a tiny random Llama target."""

    vocab_size = 512  # the target's

    @pytest.fixture(autouse=True)
    def _target(self, tmp_path_factory):
        type(self)._model = get_model("llama", tmp_path_factory.mktemp("conf"), tokenizer=True)

    def make_drafter(self, backend_class, options):
        engine = make_engine(self._model.path)
        parts = engine.parts
        options = backend_class.Options(**{**options.model_dump(), **self.extra_options()})
        drafter = backend_class(options)
        drafter.setup(draft_target(parts.model, parts.model_config, parts.kv, parts.tokenizer,
                                   torch.device("cpu"), torch.float32, parts.max_model_len, 8,
                                   parts.model.layers[0].self_attn.backend))
        return drafter

    def extra_options(self) -> dict:
        return {}


class TestLayerSkipConformance(_ModelDrafterConformance):
    backend = "layer_skip"
    options: ClassVar[dict] = {"num_layers": 1}
    decode_steps = 12


class TestDraftModelConformance(_ModelDrafterConformance):
    backend = "draft_model"
    options: ClassVar[dict] = {"model": "set-in-extra_options"}
    decode_steps = 12

    def extra_options(self) -> dict:
        return {"model": str(self._model.path)}
