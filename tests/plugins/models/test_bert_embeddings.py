"""Encoder embeddings (BERT, RoBERTa) against sentence-transformers: tiny random encoders built by
transformers with a real WordPiece tokenizer, saved by sentence-transformers with their pooling
modules, embedded by lmplug with no pooler section. Each prompt runs whole (bidirectional attention),
batched equals alone, a repeated prompt is not served from a cached prefix, generation is refused,
and a step budget that cannot hold a whole prompt is refused at load."""

from __future__ import annotations

import pytest
import torch
from support.encoders import SPECIALS, encoder_folder
from support.hf_models import one_torch_thread  # noqa: F401  (autouse fixture)

from lmplug import LLM, ConfigError, SamplingParams

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog", "tea, then more tea; and cake!",
         "zz", "one two three four five six seven eight nine ten eleven twelve"]
def st_encode(path: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


def assert_parity(got: list[list[float]], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got_t, want, dim=1).min().item() >= 0.99999
    torch.testing.assert_close(got_t, want, atol=1e-4, rtol=1e-4)


def embed(llm: LLM, texts: list[str]) -> list[list[float]]:
    return [o.outputs.embedding for o in llm.embed(texts)]


@pytest.mark.parametrize(("model_type", "mode", "normalize"), [("bert", "mean", True), ("bert", "cls", False),
                                                               ("roberta", "mean", False),
                                                               ("xlm-roberta", "cls", True)])
def test_encoder_embeddings_equal_sentence_transformers(tmp_path, model_type, mode, normalize):
    path = encoder_folder(tmp_path, model_type, mode, normalize)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64)
    assert_parity(embed(llm, TEXTS), st_encode(path, TEXTS))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return encoder_folder(tmp_path_factory.mktemp("bert"), "bert", "mean", True)


def test_batched_equals_alone_and_a_repeated_prompt_is_recomputed(bert):
    # with prefix caching, a cached prefix must not stand in for the tokens an encoder attends to
    # in both directions, even where the pool reads one row ("last")
    llm = LLM(bert, dtype="float32", device="cpu", max_model_len=64, pooler={"pooling_type": "last"},
              kvcache={"backend": "paged", "prefix_caching": True, "block_size": 4})
    alone = [embed(llm, [t])[0] for t in TEXTS]
    twice = embed(llm, TEXTS + TEXTS[::-1])
    torch.testing.assert_close(torch.tensor(twice[:len(TEXTS)]), torch.tensor(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(twice[len(TEXTS):]), torch.tensor(alone[::-1]), atol=1e-5, rtol=1e-5)
    from transformers import AutoModel, AutoTokenizer

    hf, tok = AutoModel.from_pretrained(bert).eval(), AutoTokenizer.from_pretrained(bert)
    with torch.no_grad():
        last = hf(**tok(TEXTS[2], return_tensors="pt")).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(alone[2]), torch.nn.functional.normalize(last, dim=0), atol=1e-4,
                               rtol=1e-4)


def test_a_step_budget_that_splits_prompts_still_runs_each_whole(bert):
    # a budget of exactly max_model_len (the prompts sum to more): later prompts wait for a step of their own
    llm = LLM(bert, dtype="float32", device="cpu", max_model_len=64, scheduler={"max_num_batched_tokens": 64})
    assert_parity(embed(llm, TEXTS), st_encode(bert, TEXTS))


def test_a_budget_below_the_context_is_refused_at_load(bert):
    with pytest.raises(ConfigError, match=r"encoder.*max_num_batched_tokens \(16\) must be >= max_model_len \(64\)"):
        LLM(bert, dtype="float32", device="cpu", max_model_len=64, scheduler={"max_num_batched_tokens": 16})


def test_generation_is_refused_naming_the_model(bert):
    llm = LLM(bert, dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ConfigError, match="is an encoder .*serves embeddings"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))


def test_the_tokenizer_adds_cls_and_sep(bert):
    from transformers import AutoTokenizer

    llm = LLM(bert, dtype="float32", device="cpu", max_model_len=64)
    want = AutoTokenizer.from_pretrained(bert)(TEXTS[2])["input_ids"]
    assert llm.engine.tokenizer.encode(TEXTS[2]) == want
    assert want[0] == SPECIALS.index("[CLS]") and want[-1] == SPECIALS.index("[SEP]")


def test_relative_positions_are_refused_by_name(tmp_path):
    import json

    path = encoder_folder(tmp_path, "bert", "mean", True)
    config = json.loads((tmp_path / "bert-base" / "config.json").read_text())
    (tmp_path / "bert-mean-True" / "config.json").write_text(
        json.dumps({**config, "position_embedding_type": "relative_key"}))
    from lmplug import ModelLoadError

    with pytest.raises(ModelLoadError, match="position_embedding_type"):
        LLM(path, dtype="float32", device="cpu", max_model_len=64)
