"""Tool calling through the chat API on the demo model, with the official ``openai`` client:
``tool_choice`` "required" and a named function give calls whose arguments validate against the
tool's schema (``jsonschema``); a conversation with the calls and their results goes back to the
model; streamed calls join to the whole response's; ``auto`` reads calls out of free text with the
server's parser; bad tools are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from lmplug.serve.tools import template_messages

openai = pytest.importorskip("openai")

KEY = "test-key"
MAX_LEN = 512
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)


def check_calls(calls) -> list[tuple[str, dict]]:
    """Each call is well formed and its arguments validate against its tool's schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed_calls(client, **kwargs) -> tuple[str, dict[int, dict], list[str | None]]:
    """(content, calls by index as {id, name, arguments}, finish reasons) joined from a stream."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(model="demo", stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for piece in c.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name  # first piece
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            reasons.append(c.finish_reason)
    return content, calls, reasons


# -- forced calls -----------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_validate_and_stream_the_same(client, choice):
    kwargs = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0, "max_tokens": 120}
    r = client.chat.completions.create(model="demo", **kwargs)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    calls = check_calls(c.message.tool_calls)
    assert calls
    if choice is NAMED:
        assert [name for name, _ in calls] == ["get_weather"]
    content, streamed, reasons = streamed_calls(client, **kwargs)
    assert content == "" and [r for r in reasons if r] == ["tool_calls"]
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed.values()] == calls
    assert [s["arguments"] for s in streamed.values()] == [t.function.arguments for t in c.message.tool_calls]


def test_required_sampled_n2_and_one_call_only(client):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=3, n=2, max_tokens=120, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert len(check_calls(c.message.tool_calls)) == 1


def test_forced_call_cut_by_max_tokens_is_text(client):
    """A call cut short is no call: ``length``, and the partial JSON comes back as content (streamed too)."""
    kwargs = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 5}
    c = client.chat.completions.create(model="demo", **kwargs).choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert c.message.content and c.message.content.startswith("[")
    content, streamed, reasons = streamed_calls(client, **kwargs)
    assert (content, streamed, [r for r in reasons if r]) == (c.message.content, {}, ["length"])


def test_round_trip_with_the_results(client):
    """The call and its result go back in the conversation (assistant ``tool_calls`` with null content, a
    ``tool`` message); the model answers in text."""
    first = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    r = client.chat.completions.create(model="demo", messages=conversation, tools=TOOLS, temperature=0,
                                       max_tokens=24)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls
    # the tool result reached the prompt: more prompt tokens than the question alone
    alone = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + 10


def test_template_gets_arguments_as_a_dict(server):
    """What the chat template receives for a call: arguments parsed (HF templates write them with tojson)."""
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert out[1]["name"] == "get_time" and out[1]["content"] == "12:00"


# -- auto: the parser reads calls out of free text -------------------------------------------------

# a Hermes-style call, held by a regex so that the demo model writes it (tool_choice stays "auto")
HERMES = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
          r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


def test_auto_parses_calls_whole_and_streamed(client):
    kwargs = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80,
              "extra_body": {"guided_regex": HERMES}}
    c = client.chat.completions.create(model="demo", **kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    [(name, arguments)] = check_calls(c.message.tool_calls)
    assert name == "get_weather"
    content, streamed, reasons = streamed_calls(client, **kwargs)
    assert content.strip() == "Sure." and [r for r in reasons if r] == ["tool_calls"]
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed.values()] == [(name, arguments)]


def test_auto_without_a_call_is_text(client):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="auto",
                                       temperature=0, max_tokens=12)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls


def test_tool_choice_none_does_not_parse(client):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=80, extra_body={"guided_regex": HERMES})
    c = r.choices[0]
    assert c.finish_reason == "stop" and "<tool_call>" in c.message.content and not c.message.tool_calls


# -- bad input --------------------------------------------------------------------------------------

OK = {"model": "demo", "messages": ASK, "max_tokens": 2}
BAD = [
    # (id, body, param)
    ("parameters-not-object", {**OK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    ("tool-name-invalid", {**OK, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("tool-choice-unknown", {**OK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "nope"}}}, "tool_choice"),
    ("required-without-tools", {**OK, "tool_choice": "required"}, "tool_choice"),
    ("tool-choice-and-format", {**OK, "tools": TOOLS, "tool_choice": "required",
                                "response_format": {"type": "json_object"}}, "tool_choice"),
    ("tool-message-without-id", {**OK, "messages": ASK + [{"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ("null-content-user", {**OK, "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("arguments-not-json", {**OK, "messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("tool-calls-on-user", {**OK, "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tools_are_a_400_naming_the_field(server, body, param):
    for stream in (False, True):
        resp = post(server, {**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert param.split("[")[0].split(".")[0] in error["message"]
    assert post(server, OK).status_code == 200
