"""Embeddings against sentence-transformers: a tiny random llama saved by sentence-transformers itself
with its modules (Pooling, Normalize), loaded by lmplug with no ``pooler`` section. lmplug follows the
checkpoint's recipe; its vectors equal ``SentenceTransformer(path).encode`` (cosine >= 0.99999, fp32),
Matryoshka ``dimensions`` included; recipes it cannot follow are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (autouse fixture)

from lmplug import LLM, ConfigError, ModelLoadError, PoolingParams, SamplingParams

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog", "tea, then more tea; and cake!"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("st_base"), tokenizer=True)


def st_folder(base, root, mode: str, normalize: bool, **config) -> str:
    """``base`` saved by sentence-transformers as Transformer -> Pooling(mode) [-> Normalize]."""
    from sentence_transformers import SentenceTransformer, models

    path = root / f"{mode}-{normalize}"
    shutil.rmtree(path, ignore_errors=True)
    modules = [models.Transformer(str(base.path)), models.Pooling(base.config["hidden_size"], pooling_mode=mode)]
    SentenceTransformer(modules=modules + [models.Normalize()] * normalize, device="cpu").save(str(path))
    if config:
        hf_config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**hf_config, **config}))
    return str(path)


def st_encode(path: str, texts: list[str], **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts), **kwargs).float()


def assert_parity(got: list[list[float]], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    cosine = torch.nn.functional.cosine_similarity(got_t, want, dim=1)
    assert cosine.min().item() >= 0.99999, cosine
    torch.testing.assert_close(got_t, want, atol=1e-4, rtol=1e-4)  # the norms too (no Normalize: not unit)


@pytest.mark.parametrize(("mode", "normalize"), [("lasttoken", True), ("mean", True), ("cls", False),
                                                 ("mean", False)])
def test_the_checkpoints_pooling_config_is_followed(base, tmp_path, mode, normalize):
    path = st_folder(base, tmp_path, mode, normalize)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128)  # no pooler section: the recipe
    got = [o.outputs.embedding for o in llm.embed(TEXTS)]
    assert_parity(got, st_encode(path, TEXTS))
    norms = torch.tensor(got).norm(dim=1)
    assert torch.allclose(norms, torch.ones(len(TEXTS))) == normalize


def test_the_pooler_section_overrides_the_checkpoint(base, tmp_path):
    path = st_folder(base, tmp_path, "mean", True)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, pooler={"pooling_type": "cls"})
    got = llm.embed(TEXTS[:1])[0].outputs.embedding
    ids = base_ids(base, TEXTS[0])
    with torch.no_grad():
        first = base_model(base)(torch.tensor([ids])).last_hidden_state[0, 0]
    torch.testing.assert_close(torch.tensor(got), torch.nn.functional.normalize(first, dim=0), atol=1e-4, rtol=1e-4)


def base_ids(base, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base.path)(text)["input_ids"]


def base_model(base):
    from transformers import AutoModel

    return AutoModel.from_pretrained(base.path, dtype=torch.float32).eval()


@pytest.mark.parametrize("dims", [16, 32])
def test_matryoshka_dimensions_truncate_and_renormalize(base, tmp_path, dims):
    path = st_folder(base, tmp_path, "lasttoken", True, matryoshka_dimensions=[16, 32, 64])
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128)
    got = [o.outputs.embedding for o in llm.embed(TEXTS, PoolingParams(dimensions=dims))]
    assert_parity(got, st_encode(path, TEXTS, truncate_dim=dims, normalize_embeddings=True))
    full = llm.embed(TEXTS[:1], PoolingParams(dimensions=64))[0].outputs.embedding
    assert_parity([full], st_encode(path, TEXTS[:1]))
    with pytest.raises(ConfigError, match=r"dimensions: 20 is not one of the sizes .* \(16, 32, 64\)"):
        llm.embed(TEXTS[:1], PoolingParams(dimensions=20))


def test_is_matryoshka_allows_any_size_up_to_the_hidden_size(base, tmp_path):
    path = st_folder(base, tmp_path, "mean", False, is_matryoshka=True)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128)
    got = llm.embed(TEXTS[:2], PoolingParams(dimensions=10))
    want = st_encode(path, TEXTS[:2], truncate_dim=10)  # no Normalize module: truncated, not rescaled
    assert_parity([o.outputs.embedding for o in got], want)
    with pytest.raises(ConfigError, match="dimensions: 65 is more than .* embedding size 64"):
        llm.embed(TEXTS[:1], PoolingParams(dimensions=65))


def test_a_recipe_lmplug_cannot_follow_is_refused_by_name(base, tmp_path):
    path = st_folder(base, tmp_path, "max", True)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128)
    with pytest.raises(ConfigError, match=r"cannot pool as its sentence-transformers config asks: .*1_Pooling"
                                          r".*pooling mode max; .*pooler section's pooling_type"):
        llm.embed(TEXTS[:1])
    assert len(llm.embed(TEXTS[:1], PoolingParams(pooling_type="mean"))[0].outputs.embedding) == 64


def test_a_headless_checkpoint_embeds_but_does_not_generate(base, tmp_path):
    """sentence-transformers saves the base model (``LlamaModel``, no ``model.`` prefix, no LM head)."""
    llm = LLM(st_folder(base, tmp_path, "mean", True), dtype="float32", device="cpu", max_model_len=128)
    with pytest.raises(ConfigError, match=r"saved without its LM head .* serves embeddings .* not generation"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2))


def test_the_legacy_pooling_flags_are_read(base, tmp_path):
    """Checkpoints saved before sentence-transformers v5 say ``pooling_mode_mean_tokens: true``."""
    path = st_folder(base, tmp_path, "mean", True)
    legacy = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
    (tmp_path / "mean-True" / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128)
    assert_parity([o.outputs.embedding for o in llm.embed(TEXTS)], st_encode(path, TEXTS))


def test_a_dense_module_is_refused_by_name(base, tmp_path):
    from sentence_transformers import SentenceTransformer, models

    path = tmp_path / "dense"
    SentenceTransformer(modules=[models.Transformer(str(base.path)), models.Pooling(64, pooling_mode="mean"),
                                 models.Dense(64, 8)], device="cpu").save(str(path))
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128)
    with pytest.raises(ConfigError, match=r"modules\.json chains module 'Dense'"):
        llm.embed(TEXTS[:1])


def test_a_broken_modules_json_fails_the_load_naming_the_file(base, tmp_path):
    path = st_folder(base, tmp_path, "mean", True)
    (tmp_path / "mean-True" / "modules.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"modules\.json: not readable JSON"):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)


def test_a_module_path_outside_the_checkpoint_fails_the_load(base, tmp_path):
    path = st_folder(base, tmp_path, "mean", True)
    modules_file = tmp_path / "mean-True" / "modules.json"
    modules = json.loads(modules_file.read_text())
    modules[1]["path"] = "../../elsewhere"
    modules_file.write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match=r"modules\.json: module path '\.\./\.\./elsewhere' is not a folder inside"):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)


def test_bad_matryoshka_dimensions_fail_the_load(base, tmp_path):
    path = st_folder(base, tmp_path, "mean", True, matryoshka_dimensions=[16, "32"])
    with pytest.raises(ModelLoadError, match=r"matryoshka_dimensions must be a list of positive integers"):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)
