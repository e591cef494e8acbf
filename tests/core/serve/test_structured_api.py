"""Structured output through the server (``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) on the demo model, with the official ``openai`` client: every answer
parses and validates against its JSON schema (``jsonschema``, not lmplug's code), fullmatches its
regex or is one of its choices, greedy and sampled, streamed and not; bad constraints are a 400
naming the request field, streamed or not, and the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from lmplug.interfaces.constraint import StructuredOutput

openai = pytest.importorskip("openai")

KEY = "test-key"
MAX_LEN = 512

# nested objects, an array, enums, number bounds, required and optional fields, $defs / $ref;
# strings and arrays are bounded so that even a sampled answer ends well inside max_tokens
PERSON = {
    "$defs": {
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "home", "tags"],
    "additionalProperties": False,
}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
          "maximum": 9}}, "required": ["ok", "n"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
REGEX = r"\d{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def chat(client, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) per choice; a stream is joined."""
    if not stream:
        r = client.chat.completions.create(model="demo", **kwargs)
        return [(c.message.content, c.finish_reason) for c in r.choices]
    texts, reasons = {}, {}
    for chunk in client.chat.completions.create(model="demo", stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [(texts[i], reasons[i]) for i in sorted(texts)]


SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 7}}


# -- JSON schemas ---------------------------------------------------------------------------------


def test_json_schema_greedy_validates_and_streams_the_same(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = {"messages": ASK, "max_tokens": 200, "response_format": fmt, "temperature": 0}
    [(text, reason)] = chat(client, False, **kwargs)
    assert reason == "stop", f"did not finish within max_tokens: {text!r}"
    jsonschema.validate(json.loads(text), PERSON)
    assert chat(client, True, **kwargs) == [(text, reason)]


def test_json_schema_sampled_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": False}}
    out = chat(client, False, messages=ASK, max_tokens=200, n=2, response_format=fmt, temperature=1.0, seed=7)
    assert len(out) == 2 and out[0] != out[1]
    for text, reason in out:
        assert reason == "stop", f"did not finish within max_tokens: {text!r}"
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_sampled_streams_validate(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for text, reason in chat(client, True, messages=ASK, max_tokens=200, n=3, response_format=fmt,
                             temperature=1.0, seed=seed):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("extra", [{"guided_json": json.dumps(SMALL)}, {"guided_json": SMALL},
                                   {"structured_outputs": {"json": SMALL}}],
                         ids=["guided_json-text", "guided_json", "structured_outputs"])
def test_json_schema_spellings(client, extra):
    """vLLM's spellings of a schema constraint (a dict or its JSON text)."""
    for text, reason in chat(client, False, messages=ASK, max_tokens=40, temperature=0, extra_body=extra):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SMALL)


def test_completions_guided_json(client):
    r = client.completions.create(model="demo", prompt="A person, as JSON:", max_tokens=40, n=2,
                                  temperature=1.0, seed=9, extra_body={"guided_json": SMALL})
    for c in r.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SMALL)


@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}},
                                   {"extra_body": {"structured_outputs": {"json_object": True}}}],
                         ids=["response_format", "structured_outputs"])
def test_json_object_is_a_dict(client, extra):
    ask = [{"role": "user", "content": "Return a JSON object with your name."}]
    for stream, sampling in ((False, {"temperature": 0}), (True, {"temperature": 1.0, "seed": 1})):
        for text, reason in chat(client, stream, messages=ask, max_tokens=60, **sampling, **extra):
            assert reason == "stop", text
            assert isinstance(json.loads(text), dict)


def test_cut_by_max_tokens_is_a_valid_prefix(server, client):
    """``length`` stays ``length``, and the text so far is a prefix the constraint allows (a matcher of
    the served engine's grammar backend accepts its tokens) without being a whole answer."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    [(text, reason)] = chat(client, False, messages=ASK, max_tokens=6, temperature=0, response_format=fmt)
    assert reason == "length" and text
    with pytest.raises(ValueError):
        json.loads(text)
    backend = server.engine.constraints.backend
    matcher = backend.matcher(backend.compile_cached(StructuredOutput(json=PERSON)))
    tokens = server.engine.tokenizer.encode(text, add_special_tokens=False)
    assert all(matcher.accept(t) for t in tokens)
    assert not matcher.is_complete()


# -- regex, choice, grammar -----------------------------------------------------------------------


@pytest.mark.parametrize("stream,extra", [(False, {"guided_regex": REGEX}),
                                          (True, {"structured_outputs": {"regex": REGEX}})],
                         ids=["guided_regex", "structured_outputs-stream"])
def test_regex_holds_on_every_sample(client, stream, extra):
    out = chat(client, stream, messages=[{"role": "user", "content": "A code please."}], max_tokens=20, n=4,
               temperature=1.0, seed=11, extra_body=extra)
    assert len(out) == 4
    for text, reason in out:
        assert reason == "stop" and re.fullmatch(REGEX, text), text


def test_completions_regex_n4(client):
    r = client.completions.create(model="demo", prompt="Code:", max_tokens=20, n=4, temperature=1.0, seed=5,
                                  extra_body={"guided_regex": REGEX})
    texts = [c.text for c in r.choices]
    assert len(texts) == 4 and all(re.fullmatch(REGEX, t) for t in texts), texts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_choice_holds_on_every_sample(client, stream):
    out = chat(client, stream, messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=10, n=4,
               temperature=1.0, seed=2, extra_body={"guided_choice": CHOICES})
    assert len(out) == 4
    assert all(text in CHOICES and reason == "stop" for text, reason in out), out


def test_grammar(client):
    grammar = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?'
    out = chat(client, False, messages=[{"role": "user", "content": "Yes or no, and a number?"}], max_tokens=10,
               n=3, temperature=1.0, seed=4, extra_body={"guided_grammar": grammar})
    assert all(re.fullmatch(r"(yes|no) [1-9][0-9]?", text) and reason == "stop" for text, reason in out), out


# -- bad constraints: a 400 naming the request field, streamed or not ------------------------------

OK = {"model": "demo", "messages": ASK, "max_tokens": 4}
BAD = [
    # (id, body, param)
    ("schema-invalid", {**OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("schema-missing", {**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("format-unknown", {**OK, "response_format": {"type": "xml"}}, "response_format.type"),
    ("guided-json-invalid", {**OK, "guided_json": {"type": "nonsense"}}, "guided_json"),
    ("guided-json-bad-text", {**OK, "guided_json": "{not json"}, "guided_json"),
    ("regex-invalid", {**OK, "guided_regex": "("}, "guided_regex"),
    ("grammar-invalid", {**OK, "guided_grammar": "root ::= ("}, "guided_grammar"),
    ("choice-empty", {**OK, "guided_choice": []}, "guided_choice"),
    ("two-constraints", {**OK, "guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("structured-outputs-two", {**OK, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("structured-outputs-regex", {**OK, "structured_outputs": {"regex": "("}}, "structured_outputs"),
    ("completions-regex", {"model": "demo", "prompt": "x", "guided_regex": "("}, "guided_regex"),
]


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_constraint_is_a_400_naming_the_field(server, body, param):
    """Streamed too: the engine refuses a constraint before any header goes out."""
    path = "/completions" if "prompt" in body else "/chat/completions"
    for stream in (False, True):
        resp = post(server, path, {**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert param.split(".")[0] in error["message"]
    ok = post(server, "/chat/completions", {**OK, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"

