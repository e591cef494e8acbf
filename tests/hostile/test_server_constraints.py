"""Hostile constraints through the real HTTP server (issue 45's probe bodies), on both constraint
backends: each is a 400 in OpenAI's error shape naming the request field, before any 200 — on
streams too — and the server keeps serving plain requests afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_server

from lmplug.serve import ServeSettings


# llguidance cannot read the tiny test model's tokenizer (a Fuse decoder): it runs on the demo GGUF
@pytest.fixture(scope="module", params=["xgrammar", pytest.param("llguidance", marks=pytest.mark.slow)])
def server(request, tmp_path_factory):
    if request.param == "xgrammar":
        model = get_model("llama", tmp_path_factory.mktemp("hostile-constraints"), tokenizer=True)
        llm = model.llm(kvcache="contiguous", structured_output={"backend": "xgrammar"})
    else:
        from lmplug import LLM

        llm = LLM(str(request.getfixturevalue("demo_gguf")), dtype="float32", max_model_len=256,
                  structured_output={"backend": "llguidance"})
    with running_server(llm, ServeSettings(api_key="")) as running:
        yield running


BASE = {"prompt": "hi", "max_tokens": 4}
REFUSED = [
    ("json-brackets", {"guided_json": "[" * 5000}, "guided_json"),
    ("json-not", {"guided_json": {"not": {}}}, "guided_json"),
    ("json-self-ref", {"guided_json": {"$ref": "#"}}, "guided_json"),
    ("json-deep", {"guided_json": json.loads('{"type": "array", "items": ' * 490 + '{"type": "integer"}'
                                             + "}" * 490)}, "guided_json"),
    ("json-big-enum", {"guided_json": {"enum": [f"v{i}" for i in range(60_000)]}}, "guided_json"),  # 110k: past the 1 MiB body limit
    ("grammar-root-root", {"guided_grammar": "root ::= root"}, "guided_grammar"),
]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", content=json.dumps(body).encode(), timeout=120,
                      headers={"Content-Type": "application/json"})


def check_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("name, extra, param", REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_constraint_is_400_before_any_200(server, name, extra, param, stream):
    check_400(post(server, {**BASE, **extra, "stream": stream}), param)
    plain = post(server, BASE)
    assert plain.status_code == 200, plain.text


def test_regex_nested_repeat_is_not_a_500(server, request):
    """``(a{1000}){1000}``: text of a's, or a 400 naming the field and the engine's limit."""
    if "llguidance" in request.node.name:  # known gap (issue 45, item 3): see the mark's reason
        request.applymarker(pytest.mark.xfail(strict=True, reason="llguidance hits its lexer limit after "
                                              "the first token on the demo vocabulary: the step error is "
                                              "a 500 'see the server log', not yet a clear error"))
    resp = post(server, {**BASE, "guided_regex": "(a{1000}){1000}"})
    if resp.status_code == 400:
        check_400(resp, "guided_regex")
        assert "limit" in resp.json()["error"]["message"]
        return
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert set(choice["text"]) <= {"a"} and choice["text"] and choice["finish_reason"] == "length", choice
