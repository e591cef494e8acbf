"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat completions path.

A request becomes a chat request (``plan``): ``instructions`` a system message, ``input`` (text or
items: messages, ``function_call``, ``function_call_output``) the messages after those of the
``previous_response_id`` chain, ``text.format`` a ``response_format``, function ``tools`` chat tools.
The chat answer becomes a ``response`` object (``finish``), or, streamed, the Responses events in
order (``stream``). Stored responses (``store``, default true) live in a bounded in-memory LRU.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lmplug.serve.errors import APIError

_PASSED = ("temperature", "top_p", "tool_choice", "parallel_tool_calls", "user", "seed")
_KNOWN = {"model", "input", "instructions", "max_output_tokens", "stream", "store", "previous_response_id",
          "text", "tools", "metadata", "truncation", "reasoning", "include", *_PASSED}


class ResponseStore:
    """The conversations of stored responses, newest kept: ``limit`` entries at most."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit, self._items = limit, OrderedDict()

    def get(self, response_id: str) -> list[dict]:
        if response_id not in self._items:
            raise APIError(404, f"previous_response_id: no response with id {response_id!r} is stored here "
                           "(unknown, expired, or created with store: false)", param="previous_response_id",
                           code="response_not_found")
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def put(self, response_id: str, messages: list[dict]) -> None:
        self._items[response_id] = messages
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


@dataclass
class Plan:
    body: dict  # the request as sent
    chat: dict  # the chat completions request it runs as
    messages: list[dict]  # the conversation without instructions (what a follow-up continues)
    id: str = field(default_factory=lambda: "resp_" + secrets.token_hex(12))
    created_at: int = field(default_factory=lambda: int(time.time()))


def plan(body: dict, store: ResponseStore) -> Plan:
    """The chat request for ``body``; 400 naming a field or item type it cannot take, 404 for an
    unknown ``previous_response_id``."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise APIError(400, f"{unknown[0]}: not supported by this server's /v1/responses", param=unknown[0])
    if "input" not in body:
        raise APIError(400, "input: required (text, or a list of input items)", param="input")
    previous = body.get("previous_response_id")
    history = list(store.get(previous)) if previous else []
    messages = history + input_messages(body["input"])
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": _text(body["instructions"], "instructions")}]
                                         if body.get("instructions") else []) + messages}
    chat.update({k: body[k] for k in _PASSED if body.get(k) is not None})
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if isinstance(chat.get("tool_choice"), dict) and "name" in chat["tool_choice"]:
        chat["tool_choice"] = {"type": "function", "function": {"name": chat["tool_choice"]["name"]}}
    if body.get("tools"):
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body["tools"])]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt and fmt.get("type") != "text":
        chat["response_format"] = _response_format(fmt)
    if body.get("stream"):
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return Plan(body, chat, messages)


def input_messages(value: Any) -> list[dict]:
    """Responses ``input`` -> chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError(400, "input: expected text or a non-empty list of items", param="input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: expected an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise APIError(400, f"{where}.type: item type {kind!r} is not supported (message, function_call, "
                           "function_call_output)", param=f"{where}.type")
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: expected text or a list of parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}.content[{j}].type: part type {kind!r} is not supported (input_text, "
                           "output_text)", param=f"{where}.content[{j}].type")
        texts.append(_text(part.get("text"), f"{where}.content[{j}].text"))
    return "".join(texts)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where}: expected a string", param=where)
    return value


def _chat_tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(400, f"tools[{i}].type: tool type {kind!r} is not supported (function)",
                       param=f"tools[{i}].type")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _response_format(fmt: dict) -> dict:
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") != "json_schema":
        raise APIError(400, f"text.format.type: {fmt.get('type')!r} is not supported (text, json_object, "
                       "json_schema)", param="text.format.type")
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def output_items(message: dict) -> list[dict]:
    """A chat answer's message -> Responses output items (text, then function calls)."""
    items = []
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or "msg_" + secrets.token_hex(12), "status": status,
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}


def response_object(p: Plan, items: list[dict], finish_reason: str | None, usage: dict | None,
                    model: str, status: str | None = None) -> dict:
    body = p.body
    cut = finish_reason == "length"
    usage = usage or {}
    return {"id": p.id, "object": "response", "created_at": p.created_at, "model": model,
            "status": status or ("incomplete" if cut else "completed"), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut and not status else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "output": items,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "truncation": body.get("truncation", "disabled"),
            "usage": None if status else {
                "input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0), "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}}


def _remember(p: Plan, store: ResponseStore, message: dict) -> None:
    if p.body.get("store", True) is not False:
        kept = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            kept["tool_calls"] = message["tool_calls"]
        store.put(p.id, [*p.messages, kept])


def finish(chat_body: dict, p: Plan, store: ResponseStore, model: str) -> dict:
    """A non-streamed chat completion -> the response object (stored unless ``store: false``)."""
    choice = chat_body["choices"][0]
    _remember(p, store, choice["message"])
    return response_object(p, output_items(choice["message"]), choice.get("finish_reason"),
                           chat_body.get("usage"), model)


async def stream(chunks: AsyncIterator[Any], p: Plan, store: ResponseStore, model: str) -> AsyncIterator[str]:
    """Chat completion chunks (SSE lines) -> the Responses events, in order."""
    events = _Events()
    yield events.emit("response.created", response=response_object(p, [], None, None, model, "in_progress"))
    yield events.emit("response.in_progress", response=response_object(p, [], None, None, model, "in_progress"))
    text, calls, finish_reason, usage, item_id = [], {}, None, None, "msg_" + secrets.token_hex(12)
    try:
        async for raw in chunks:
            for chunk in _chunks(raw):
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    finish_reason = choice.get("finish_reason") or finish_reason
                    delta = choice.get("delta") or {}
                    for call in delta.get("tool_calls") or []:
                        _merge_call(calls, call)
                    if delta.get("content"):
                        if not text:
                            yield events.emit("response.output_item.added", output_index=0,
                                              item=_message_item("", "in_progress", item_id) | {"content": []})
                            yield events.emit("response.content_part.added", item_id=item_id, output_index=0,
                                              content_index=0, part={"type": "output_text", "text": "",
                                                                     "annotations": []})
                        text.append(delta["content"])
                        yield events.emit("response.output_text.delta", item_id=item_id, output_index=0,
                                          content_index=0, delta=delta["content"])
    finally:
        await chunks.aclose()
    message = {"content": "".join(text) or None,
               "tool_calls": [calls[k] for k in sorted(calls)] or None}
    items = output_items(message)
    if text:
        items[0]["id"] = item_id
        done = "".join(text)
        yield events.emit("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=done)
        yield events.emit("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                          part=items[0]["content"][0])
        yield events.emit("response.output_item.done", output_index=0, item=items[0])
    for index, item in enumerate(items[1:] if text else items, start=1 if text else 0):
        yield events.emit("response.output_item.added", output_index=index, item=item | {"status": "in_progress"})
        yield events.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=item["arguments"])
        yield events.emit("response.output_item.done", output_index=index, item=item)
    _remember(p, store, message)
    final = response_object(p, items, finish_reason, usage, model)
    yield events.emit("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                      response=final)


class _Events:
    def __init__(self) -> None:
        self.sequence = 0

    def emit(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


def _chunks(raw: Any) -> list[dict]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            data = json.loads(line[6:])
            if "error" in data:
                raise APIError(500, str(data["error"].get("message", data["error"])))
            out.append(data)
    return out


def _merge_call(calls: dict, call: dict) -> None:
    index = call.get("index", 0)
    have = calls.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    have["id"] = call.get("id") or have["id"]
    fn = call.get("function") or {}
    have["function"]["name"] += fn.get("name") or ""
    have["function"]["arguments"] += fn.get("arguments") or ""
