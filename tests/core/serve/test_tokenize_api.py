"""/tokenize, /detokenize (and under /v1) and /version against a real server on the demo model."""

from __future__ import annotations

import httpx
import pytest

from lmplug import __version__

from .conftest import KEY

HEADERS = {"Authorization": f"Bearer {KEY}"}
TEXT = "Hello world, 2+2=4. Ünïcödé too!"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_round_trip_in_vllms_shape(server, prefix) -> None:
    got = post(server, f"{prefix}/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert got.status_code == 200, got.text
    body = got.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 5
    assert body["max_model_len"] == server.engine.max_model_len
    assert "".join(body["token_strs"]).endswith("too!")
    back = post(server, f"{prefix}/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json()["prompt"].endswith(TEXT)  # a BOS, where the model adds one, comes first


def test_tokenize_messages_counts_what_chat_prefills(server, client) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    got = post(server, "/tokenize", {"model": "demo", "messages": messages})
    assert got.status_code == 200, got.text
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=1, temperature=0)
    assert got.json()["count"] == chat.usage.prompt_tokens


def test_version(server) -> None:
    got = httpx.get(server.url + "/version", headers=HEADERS, timeout=10)
    assert got.status_code == 200 and got.json() == {"version": __version__}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
])
def test_bad_input_is_an_openai_error(server, path, body, param) -> None:
    got = post(server, path, body)
    assert got.status_code in (400, 404), got.text
    error = got.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_key_is_required(server) -> None:
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a"}, timeout=10).status_code == 401
