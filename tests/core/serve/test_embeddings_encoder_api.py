"""/v1/embeddings on an encoder (a tiny random BERT saved by sentence-transformers: mean pooling and
Normalize) with the official ``openai`` client: float and base64 vectors equal
``SentenceTransformer.encode`` for a batch of 32 texts of mixed lengths; completions are a 400
naming the encoder."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from support.encoders import encoder_folder
from support.serve_util import running_server

from lmplug import LLM
from lmplug.serve import ServeSettings

from .conftest import KEY  # and its `client` fixture, on this module's `server`

TEXTS = [("tea " * (i % 9)) + f"cup {i}" for i in range(32)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return encoder_folder(tmp_path_factory.mktemp("encoder_api"), "bert", "mean", True)


@pytest.fixture(scope="module")
def server(folder):
    llm = LLM(folder, dtype="float32", device="cpu", max_model_len=64)
    with running_server(llm, ServeSettings(api_key=KEY, served_model_name="bert")) as running:
        yield running


def st_encode(folder, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu").encode(texts, convert_to_tensor=True).float()


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_a_batch_of_32_equals_sentence_transformers(client, folder, encoding):
    data = client.embeddings.create(model="bert", input=TEXTS, encoding_format=encoding).data
    if encoding == "base64":  # the client hands base64 back as the server sent it
        rows = [np.frombuffer(base64.b64decode(d.embedding), dtype=np.float32) for d in data]
    else:
        rows = [d.embedding for d in data]
    got = torch.tensor(np.array(rows, dtype=np.float32))
    want = st_encode(folder, TEXTS)
    assert got.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got, want, dim=1).min().item() >= 0.99999
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_completions_on_an_encoder_are_a_400_naming_it(server):
    got = httpx.post(server.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert got.status_code == 400, got.text
    assert "is an encoder" in got.json()["error"]["message"]
