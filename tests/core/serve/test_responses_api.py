"""/v1/responses with the official openai client against a real server on the demo model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from .conftest import KEY

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "adult": {"type": "boolean"}},
          "required": ["name", "adult"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def chat_text(client, messages, n: int) -> str:
    out = client.chat.completions.create(model="demo", messages=messages, max_tokens=n, temperature=0)
    return out.choices[0].message.content


def test_text_equals_the_chat_answer(client) -> None:
    got = client.responses.create(model="demo", input="What is the capital of France?",
                                  instructions="Answer in one word.", max_output_tokens=8, temperature=0)
    want = chat_text(client, [{"role": "system", "content": "Answer in one word."},
                              {"role": "user", "content": "What is the capital of France?"}], 8)
    assert got.object == "response" and got.id.startswith("resp_")
    assert got.output_text == want and want
    assert got.usage.output_tokens <= 8 and got.usage.input_tokens > 0


def test_max_output_tokens_makes_it_incomplete(client) -> None:
    got = client.responses.create(model="demo", input="Write a long story about a dragon.",
                                  max_output_tokens=4, temperature=0)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.output_tokens == 4


def test_json_schema_output(client) -> None:
    got = client.responses.create(model="demo", input="Invent a person.", max_output_tokens=96, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                                                   "strict": True}})
    assert got.status == "completed", got.output_text
    jsonschema.validate(json.loads(got.output_text), SCHEMA)


def test_previous_response_id_continues_the_conversation(client) -> None:
    first = client.responses.create(model="demo", input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model="demo", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    want = chat_text(client, [{"role": "user", "content": "My name is Ada."},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "What is my name?"}], 8)
    assert second.output_text == want
    assert second.previous_response_id == first.id


def test_store_false_is_not_kept(client) -> None:
    first = client.responses.create(model="demo", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="demo", input="Again", previous_response_id=first.id, max_output_tokens=2)
    assert "previous_response_id" in str(err.value)


def test_tool_round_trip(client) -> None:
    first = client.responses.create(model="demo", input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments), dict)
    second = client.responses.create(
        model="demo", tools=[WEATHER], max_output_tokens=16, temperature=0, previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert second.status in ("completed", "incomplete") and second.output


def test_stream_events_in_order(client) -> None:
    kwargs = {"model": "demo", "input": "Count to three.", "max_output_tokens": 12, "temperature": 0}
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          kinds[-1]] and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == client.responses.create(**kwargs).output_text


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input[0].type"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({}, 400, "input"),
])
def test_bad_input(server, body, status, param) -> None:
    got = httpx.post(server.v1 + "/responses", json={"model": "demo", **body},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert got.status_code == status, got.text
    assert got.json()["error"]["param"] == param
