"""Issue 45, item 4, through the real server on the demo model: with ``tools=[get_weather]`` the
model is made (by ``guided_regex``) to write a call to a tool nobody declared, or to a declared
tool with arguments its schema refuses. None of it comes back as a tool call, whole or streamed:
it stays in ``content`` and ``finish_reason`` is not ``"tool_calls"``."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from support.hf_models import one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_server

from lmplug import LLM
from lmplug.serve import ServeSettings

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# the probe's model outputs, forced as written
UNDECLARED = '<tool_call>{"name": "delete_all_files", "arguments": {"path": "/"}}</tool_call>'
ODD_NAME = '<tool_call>{"name": "../../x y", "arguments": {}}</tool_call>'
INVALID = '<tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>'
VALID = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def server(demo_gguf):
    llm = LLM(str(demo_gguf), dtype="float32", max_model_len=512)
    with running_server(llm, ServeSettings(api_key="", served_model_name="demo")) as running:
        yield running


def body(text: str, stream: bool) -> dict:
    return {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "temperature": 0, "max_tokens": 60,
            "stream": stream, "guided_regex": re.escape(text)}


def whole(server, text: str) -> dict:
    resp = httpx.post(server.v1 + "/chat/completions", json=body(text, False), timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def streamed(server, text: str) -> tuple[str, list, list]:
    content, calls, reasons = "", [], []
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body(text, True), timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                content += c["delta"].get("content") or ""
                calls += c["delta"].get("tool_calls") or []
                reasons.append(c.get("finish_reason"))
    return content, calls, reasons


@pytest.mark.parametrize("text", [UNDECLARED, ODD_NAME, INVALID], ids=["undeclared", "odd-name", "invalid-args"])
def test_calls_the_request_did_not_declare_stay_content(server, text):
    c = whole(server, text)
    assert not c["message"].get("tool_calls") and c["finish_reason"] != "tool_calls", c
    assert c["message"]["content"] == text
    content, calls, reasons = streamed(server, text)
    assert calls == [] and "tool_calls" not in reasons and content == text


def test_a_declared_valid_call_is_still_a_call(server):
    c = whole(server, VALID)
    assert c["finish_reason"] == "tool_calls"
    [call] = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
