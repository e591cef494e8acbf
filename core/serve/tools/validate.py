"""Which tool calls a request may get back: only calls to the functions it declared, with
arguments that validate against that function's ``parameters`` schema.

A client dispatches calls by name; a model that writes ``delete_all_files`` (or ``../../x y``)
when only ``get_weather`` was declared, or ``{"city": 3}`` for a string, has not made a call the
client can trust, so that text stays content. The schemas were checked by ``check_tools``
(``jsonschema``, the reference implementation, a runtime dependency for this reason: the
subset OpenAI tool schemas use still includes ``$ref``, ``anyOf`` and ``pattern``, which a
home-made validator would get wrong in the cases that matter here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema


class CallCheck:
    """The declared tools of one request, ready to judge calls; ``None`` tools: nothing is
    declared, so no call is accepted."""

    def __init__(self, tools: Sequence[dict] | None) -> None:
        self._validators: dict[str, Any] = {}
        for tool in tools or ():
            fn = tool["function"]
            schema = fn.get("parameters") or {"type": "object"}
            self._validators[fn["name"]] = jsonschema.validators.validator_for(schema)(schema)

    def accepts(self, name: str, arguments: str) -> bool:
        """Whether ``name`` was declared and ``arguments`` (JSON text of an object) validate."""
        validator = self._validators.get(name)
        if validator is None:
            return False
        try:
            return validator.is_valid(json.loads(arguments))
        except (ValueError, RecursionError):  # not JSON, or nested past what the check can walk
            return False
