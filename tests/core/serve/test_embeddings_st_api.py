"""/v1/embeddings on a sentence-transformers checkpoint (a tiny random llama saved by
sentence-transformers: mean pooling, Normalize, Matryoshka sizes in config.json), with the official
``openai`` client: vectors and ``dimensions`` equal ``SentenceTransformer.encode``; a size the model
was not trained for is a 400 naming ``dimensions``; the headless checkpoint refuses completions."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from support.hf_models import get_model
from support.serve_util import running_server

from lmplug import LLM
from lmplug.serve import ServeSettings

from .conftest import KEY  # and its `client` fixture, on this module's `server`

TEXTS = ["hello world", "tea and cake", "a", "the rest of the day is in the sun"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from sentence_transformers import SentenceTransformer, models

    base = get_model("llama", tmp_path_factory.mktemp("st_api_base"), tokenizer=True)
    path = tmp_path_factory.mktemp("st_api") / "st"
    SentenceTransformer(modules=[models.Transformer(str(base.path)), models.Pooling(64, pooling_mode="mean"),
                                 models.Normalize()], device="cpu").save(str(path))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    return path


@pytest.fixture(scope="module")
def server(folder):
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=64)
    with running_server(llm, ServeSettings(api_key=KEY, served_model_name="st")) as running:
        yield running


def st_encode(folder, texts: list[str], **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, **kwargs).float()


@pytest.mark.parametrize("dims", [None, 16, 32])
def test_vectors_and_dimensions_equal_sentence_transformers(client, folder, dims):
    kwargs = {} if dims is None else {"dimensions": dims}
    got = torch.tensor([d.embedding for d in client.embeddings.create(model="st", input=TEXTS, **kwargs).data])
    want = st_encode(folder, TEXTS, **({} if dims is None else {"truncate_dim": dims, "normalize_embeddings": True}))
    assert got.shape == (len(TEXTS), dims or 64)
    assert torch.nn.functional.cosine_similarity(got, want, dim=1).min().item() >= 0.99999
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_a_size_not_trained_for_is_a_400_naming_dimensions(server):
    got = post(server, "/embeddings", {"input": "hi", "dimensions": 20})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "dimensions" and "(16, 32, 64)" in error["message"]


def test_completions_on_a_headless_checkpoint_are_refused(server):
    got = post(server, "/completions", {"prompt": "hi", "max_tokens": 2})
    assert got.status_code == 400, got.text
    assert "without its LM head" in got.json()["error"]["message"]
