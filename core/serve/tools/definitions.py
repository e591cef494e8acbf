"""Tool definitions as the OpenAI chat API sends them, checked before anything uses them.

A request's ``tools`` reach the chat template (the model reads them), the grammar engine (a
forced ``tool_choice`` becomes a JSON schema) and the parsers' callers. Each is checked here once,
with errors that name the request field (``tools[1].function.parameters``), and returned as a
normalized copy: ``parameters`` is always an object schema, so everything downstream can rely on it.
"""

from __future__ import annotations

import copy
import json
import math
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from lmplug.errors import ConfigError
from lmplug.interfaces.constraint import MAX_SPEC_CHARS

MAX_TOOLS = 128
# A tool's parameters nest at most this deep (objects and arrays): real tool schemas nest a few
# levels; the schema check (jsonschema) recurses several frames per level and would otherwise
# hit Python's recursion limit at a few hundred levels, a 500 instead of a 400.
MAX_SCHEMA_DEPTH = 64
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_ID_CHARS = string.ascii_letters + string.digits


class ToolError(ConfigError):
    """A tool definition, ``tool_choice`` or tool-call output that cannot be used; ``field`` is the
    request field it came from, so the server's 400 can name it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is compact JSON text of an object, as OpenAI
    clients expect (they ``json.loads`` it)."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """``call_`` + 24 random letters and digits, the shape OpenAI's ids have."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def compact_json(value: Any) -> str:
    """The one spelling of arguments every path produces (parsers, streams, forced calls):
    compact separators, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def strict_loads(text: str) -> Any:
    """``json.loads`` that refuses what is not JSON but Python accepts (``NaN``, ``Infinity``,
    numbers too large for a float), so every parsed value can be written back as JSON."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite_float)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} does not fit a float")
    return value


def check_tools(tools: Any) -> list[dict]:
    """Validate OpenAI ``tools`` and return normalized copies.

    Each entry is ``{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}``. ``parameters`` must be a JSON schema of an object; absent means no arguments
    (``{"type": "object", "properties": {}}``) and a schema without ``type`` gets ``"object"``,
    since a call's arguments are always an object. Names are unique, at most 128 tools.
    """
    if not isinstance(tools, (list, tuple)):
        raise ToolError("tools", f"tools: expected a list of tool definitions, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"tools: {len(tools)} tools given, at most {MAX_TOOLS} are allowed")
    out: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ToolError(where, f"{where}: expected an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ToolError(f"{where}.type", f"{where}.type: expected \"function\", got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ToolError(f"{where}.function", f"{where}.function: expected an object with a name")
        normalized = _check_function(fn, f"{where}.function")
        name = normalized["name"]
        if name in seen:
            raise ToolError(f"{where}.function.name", f"{where}.function.name: {name!r} is already the "
                            f"name of tools[{seen[name]}]; tool names must be unique")
        seen[name] = i
        out.append({"type": "function", "function": normalized})
    return out


def _check_function(fn: Mapping, where: str) -> dict:
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ToolError(f"{where}.name", f"{where}.name: expected 1 to 64 letters, digits, '_' or '-', "
                        f"got {name!r}")
    out: dict[str, Any] = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise ToolError(f"{where}.description", f"{where}.description: expected a string")
        out["description"] = description
    out["parameters"] = _check_parameters(fn.get("parameters"), f"{where}.parameters")
    strict = fn.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise ToolError(f"{where}.strict", f"{where}.strict: expected true or false, got {strict!r}")
        out["strict"] = strict
    return out


def _check_parameters(schema: Any, where: str) -> dict:
    if schema is None:
        return copy.deepcopy(EMPTY_PARAMETERS)
    if not isinstance(schema, Mapping):
        raise ToolError(where, f"{where}: expected a JSON schema object, got {type(schema).__name__}")
    depth = nesting_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ToolError(where, f"{where}: nested {depth} levels deep (at most {MAX_SCHEMA_DEPTH})")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ToolError(where, f"{where}: not serialisable as JSON: {exc}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise ToolError(where, f"{where}: a schema of {len(text)} characters (at most {MAX_SPEC_CHARS})")
    schema = json.loads(text)
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise ToolError(where, f"{where}: the arguments of a function are an object; expected "
                        f"\"type\": \"object\", got {kind!r}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.path)
        raise ToolError(where, f"{where}{path}: not a valid JSON schema: {exc.message}") from None
    return schema


def nesting_depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (a scalar: 0), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
