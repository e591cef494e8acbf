"""``tool_choice``: which outputs a request allows, as a grammar constraint, and reading them back.

``"required"`` and a named function force the model to call tools, so the output is held to a
JSON schema (the grammar engine of the ``constraint`` family does the holding) and read back by
:func:`forced_calls`, whatever format the model would otherwise write calls in. ``"auto"`` and
``"none"`` leave the output free; a tool parser reads calls out of it afterwards (``"none"``:
the server does not parse).

``"required"`` is an array of one or more ``{"name": ..., "parameters": {...}}`` objects, with
``anyOf`` over the tools so that each call's parameters match its own tool's schema (as vLLM
does); a named function is that function's parameters schema alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmplug.interfaces.constraint import ConstraintError, StructuredOutput
from lmplug.serve.tools.definitions import (
    ToolCall,
    ToolError,
    check_tools,
    compact_json,
    new_call_id,
    strict_loads,
)
from lmplug.serve.tools.validate import CallCheck

FREE_CHOICES = (None, "auto", "none")


def constraint_for(tools: list | None, tool_choice: Any) -> StructuredOutput | None:
    """The constraint ``tool_choice`` puts on the output: None when the output is free."""
    kind, name, by_name = _resolve(tools, tool_choice)
    if kind is None:
        return None
    if kind == "named":
        schema: dict = by_name[name]
    else:
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": tool_name}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for tool_name, params in by_name.items()]}}
    try:
        return StructuredOutput(json=schema)
    except ConstraintError as exc:
        raise ToolError("tools", f"tools: the schema tool_choice={tool_choice!r} needs is unusable: {exc}") from None


def forced_calls(text: str, tools: list | None, tool_choice: Any) -> list[ToolCall]:
    """The calls in an output written under :func:`constraint_for`'s constraint.

    The grammar makes any finished output parse; text that does not was cut short (the request's
    ``max_tokens`` ran out mid-call), and the message says so.
    """
    kind, name, _ = _resolve(tools, tool_choice)
    check = CallCheck(check_tools(tools or []))
    if kind is None:
        raise ToolError("tool_choice", f"tool_choice={tool_choice!r} does not force a call; parse the "
                        "output with a tool parser instead")
    try:
        value = strict_loads(text)
    except ValueError:
        raise ToolError("tool_choice", f"tool_choice={tool_choice!r}: the output is not complete JSON "
                        f"({len(text)} characters); it was most likely cut off by max_tokens before "
                        "the call was finished") from None
    if kind == "named":
        if not isinstance(value, dict):
            raise ToolError("tool_choice", f"tool_choice={tool_choice!r}: expected a JSON object of "
                            f"arguments, got {type(value).__name__}")
        calls = [ToolCall(new_call_id(), name, compact_json(value))]
        return _declared(calls, check, tool_choice)
    if not isinstance(value, list) or not value:
        raise ToolError("tool_choice", "tool_choice='required': expected a non-empty JSON array of calls")
    calls = []
    for i, item in enumerate(value):
        ok = (isinstance(item, dict) and isinstance(item.get("name"), str)
              and isinstance(item.get("parameters"), dict))
        if not ok:
            raise ToolError("tool_choice", f"tool_choice='required': call {i} of the output is not "
                            "{\"name\": ..., \"parameters\": {...}}")
        calls.append(ToolCall(new_call_id(), item["name"], compact_json(item["parameters"])))
    return _declared(calls, check, tool_choice)


def _declared(calls: list[ToolCall], check: CallCheck, tool_choice: Any) -> list[ToolCall]:
    """The grammar should keep forced calls declared and valid; they are checked again anyway,
    since a call the client dispatches must never rest on one component alone."""
    for i, c in enumerate(calls):
        if not check.accepts(c.name, c.arguments):
            raise ToolError("tool_choice", f"tool_choice={tool_choice!r}: call {i} ({c.name!r}) is not a "
                            "declared tool with arguments valid against its parameters")
    return calls


def _resolve(tools: list | None, tool_choice: Any) -> tuple[str | None, str | None, dict[str, dict]]:
    """(``None`` | ``"required"`` | ``"named"``, the named function, parameters by tool name)."""
    if tool_choice in FREE_CHOICES:
        return None, None, {}
    if tool_choice == "required":
        name = None
    elif (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), Mapping)
          and isinstance(tool_choice["function"].get("name"), str)):
        name = tool_choice["function"]["name"]
    else:
        raise ToolError("tool_choice", "tool_choice: expected \"none\", \"auto\", \"required\" or "
                        f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in check_tools(tools or [])}
    if not by_name:
        raise ToolError("tool_choice", f"tool_choice={tool_choice!r} needs tools, and the request has none")
    if name is None:
        return "required", None, by_name
    if name not in by_name:
        raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not among the "
                        f"request's tools ({', '.join(sorted(by_name))})")
    return "named", name, by_name
