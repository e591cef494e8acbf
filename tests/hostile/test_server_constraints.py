"""Hostile constraints through the real HTTP server (issue 45's probe bodies), on both constraint
backends: each is a 400 in OpenAI's error shape naming the request field, before any 200 — on
streams too — and the server keeps serving plain requests afterwards."""

from __future__ import annotations

import json
import threading

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
        # a long max_compile_s: xgrammar compiles the 4,096 long choices for seconds (minutes when loaded)
        llm = model.llm(kvcache="contiguous", structured_output={"backend": "xgrammar", "max_compile_s": 900})
    else:
        from lmplug import LLM

        llm = LLM(str(request.getfixturevalue("demo_gguf")), dtype="float32", max_model_len=256,
                  structured_output={"backend": "llguidance", "max_compile_s": 900})
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


@pytest.mark.parametrize("extra, param", [({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
                                          ({"guided_grammar": 'root ::= "a"{1000000000}'}, "guided_grammar")],
                         ids=["regex-nested-repeat", "grammar-huge-repeat"])
def test_huge_repetition_is_refused_naming_the_limit(server, extra, param):
    """Both backends the same way: a 400 naming the field and ``max_repeat``, before compiling
    (llguidance used to stop mid-generation with a 500, xgrammar to diverge)."""
    resp = post(server, {**BASE, **extra})
    check_400(resp, param)
    assert "max_repeat" in resp.json()["error"]["message"] and "limit" in resp.json()["error"]["message"]
    assert post(server, BASE).status_code == 200


LONG_CHOICES = [f"option number {i} " + "x" * 200 for i in range(4096)]  # the probe's: 4,096 long options


@pytest.mark.slow
def test_long_choices_compile_off_the_engine_thread(server, request):
    """4,096 long choices run correctly on both backends (text a prefix of one choice); on
    xgrammar, whose compile takes seconds, a plain request sent meanwhile finishes while the
    constrained one is still compiling: it waits outside the engine, the others do not."""
    async_engine = server.server.engine
    result: dict = {}
    heavy = threading.Thread(target=lambda: result.update(resp=post(server, {**BASE, "guided_choice": LONG_CHOICES})))
    heavy.start()
    compiling = server.wait_for(lambda: async_engine._compiling or result, timeout=60)
    assert compiling
    if "xgrammar" in request.node.name:
        assert async_engine._compiling, "the long-choice compile ended before a plain request could run"
        plain = post(server, BASE)
        assert plain.status_code == 200, plain.text
        assert heavy.is_alive() and async_engine._compiling, "the plain request waited for the compile"
    heavy.join()
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["text"]
    assert text and any(c.startswith(text) for c in LONG_CHOICES), text
