"""/v1/embeddings with the official ``openai`` client against a real server on a tiny random llama:
vectors checked against transformers' ``AutoModel`` last hidden state (last token, normalized)."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from support.hf_models import get_model
from support.serve_util import running_server

from lmplug import LLM
from lmplug.serve import ServeSettings

from .conftest import KEY  # and its `client` fixture, on this module's `server`

HEADERS = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("emb_api"), tokenizer=True)


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=MAX_LEN)
    with running_server(llm, ServeSettings(api_key=KEY, served_model_name="tiny")) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny):
    from transformers import AutoModel, AutoTokenizer

    hf = AutoModel.from_pretrained(tiny.path, dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(tiny.path)

    def embed(item: str | list[int]) -> torch.Tensor:
        ids = tok(item)["input_ids"] if isinstance(item, str) else item
        with torch.no_grad():
            last = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=0)

    return embed


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/embeddings", json=body, headers=HEADERS, timeout=60)


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_openai_client_float_and_base64(client, reference, fmt):
    texts = ["hello world", "a b c d e f"]
    got = client.embeddings.create(model="tiny", input=texts, encoding_format=fmt)
    assert [d.index for d in got.data] == [0, 1]
    assert got.model == "tiny" and got.usage.prompt_tokens == got.usage.total_tokens > 2
    for text, item in zip(texts, got.data):
        vector = item.embedding
        if fmt == "base64":  # the client hands base64 back as the server sent it
            import base64

            import numpy as np
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4").tolist()
        torch.testing.assert_close(torch.tensor(vector), reference(text), atol=1e-4, rtol=1e-4)


def test_client_default_encoding_decodes(client, reference):
    """The ``openai`` client asks for base64 when no format is given and decodes it to floats."""
    got = client.embeddings.create(model="tiny", input="hello world")
    torch.testing.assert_close(torch.tensor(got.data[0].embedding), reference("hello world"), atol=1e-4, rtol=1e-4)


def test_batch_of_32_mixed_lengths_as_token_ids(client, reference):
    rng = random.Random(0)
    batch = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, MAX_LEN + 1))] for _ in range(32)]
    got = client.embeddings.create(model="tiny", input=batch, encoding_format="float")
    assert len(got.data) == 32 and got.usage.prompt_tokens == sum(map(len, batch))
    for ids, item in zip(batch, got.data):
        torch.testing.assert_close(torch.tensor(item.embedding), reference(ids), atol=1e-4, rtol=1e-4)
    one = client.embeddings.create(model="tiny", input=batch[5], encoding_format="float")  # a list of ids
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), torch.tensor(got.data[5].embedding),
                               atol=1e-5, rtol=1e-5)


def test_batch_of_32_mixed_length_texts(client, reference):
    rng = random.Random(1)
    words = ["tea", "the", "and", "of", "cake", "a", "is", "in", "more", "then"]
    batch = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 14))) for _ in range(32)]
    got = client.embeddings.create(model="tiny", input=batch)  # base64 on the wire, decoded by the client
    assert [d.index for d in got.data] == list(range(32))
    for text, item in zip(batch, got.data):
        torch.testing.assert_close(torch.tensor(item.embedding), reference(text), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": []}, "input", "empty list"),
    ({"input": [[5, 6], []]}, "input", "input[1]: empty"),
    ({"input": [[5] * (MAX_LEN + 1)]}, "input", f"65 tokens, more than this model's max_model_len={MAX_LEN}"),
    ({"input": "ab" * MAX_LEN}, "input", "more than this model's max_model_len"),
    ({"input": [[5, 9999]]}, "input", "9999 is not a token id"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "no Matryoshka dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": "hi", "model": "other"}, "model", "not served here"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param, says):
    got = post(server, body)
    assert got.status_code in (400, 404), got.text
    error = got.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_model_that_cannot_pool_is_named(server, monkeypatch):
    model = server.engine.runner.model
    monkeypatch.setattr(model, "final_hidden_states", False)
    got = post(server, {"input": "hi"})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "model" and "cannot pool" in error["message"]
    assert "native architectures" in error["message"] and str(server.engine.config.model) in error["message"]
