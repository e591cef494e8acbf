"""Chat messages in the shape HF chat templates expect, from OpenAI's.

OpenAI sends an assistant turn's calls as ``tool_calls: [{"id", "type": "function", "function":
{"name", "arguments": "<JSON text>"}}]`` and each result as ``{"role": "tool", "tool_call_id",
"content"}``. HF templates (Qwen2.5/3, Llama 3.1, Mistral, Hermes) follow transformers' chat
convention instead: ``arguments`` is a dict, which they write with ``tojson``; a string would be
written as a quoted string (Qwen3's template writes strings raw, so a dict suits both). So the
arguments are parsed here, the ids kept (Mistral's templates write them), and each tool result
is passed through, with the called function's ``name`` added when the request left it out and
an earlier call's id tells it (some templates label results by function name).
"""

from __future__ import annotations

from collections.abc import Mapping

from lmplug.serve.tools.definitions import ToolError, strict_loads


def template_messages(messages: list) -> list[dict]:
    """Copies of ``messages`` ready for ``apply_chat_template``; other messages are unchanged."""
    names: dict[str, str] = {}
    out: list[dict] = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            message["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]", names)
                                     for j, call in enumerate(message["tool_calls"])]
        elif message.get("role") == "tool" and "name" not in message:
            name = names.get(message.get("tool_call_id"))
            if name is not None:
                message["name"] = name
        out.append(message)
    return out


def _template_call(call: Mapping, where: str, names: dict[str, str]) -> dict:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ToolError(where, f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                        "\"arguments\"}}}}")
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = strict_loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ToolError(f"{where}.function.arguments", f"{where}.function.arguments: not valid JSON "
                            f"text: {exc}") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolError(f"{where}.function.arguments", f"{where}.function.arguments: expected a JSON "
                        f"object, got {type(arguments).__name__}")
    out = {**call, "type": "function", "function": {**fn, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        names[call["id"]] = fn["name"]
    return out
