"""Checks of a constraint before and after it is compiled, shared by every constraint backend.

Before: a JSON schema's nesting depth and enum sizes are bounded (``max_schema_depth``,
``max_enum_values``), so a hostile schema is refused with an error naming the limit instead of
running the grammar engine (and Python's recursion) for seconds. ``not`` is refused: no backend
implements it (xgrammar ignores it, so ``{"not": {}}`` would produce JSON that violates it).

After: a constraint that no string satisfies (``root ::= root``, a ``$ref`` to itself) leaves a
fresh matcher with no token but EOS allowed while it is not complete; such a constraint is
refused at admission, where generating would only end in an empty "stop" or a step error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmplug.interfaces.constraint import ConstraintBackend, StructuredOutput

NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def check_before_compile(spec: StructuredOutput, max_depth: int, max_enum: int) -> None:
    """Raise ``ConstraintError`` if ``spec``'s JSON schema nests deeper than ``max_depth`` or
    lists more than ``max_enum`` enum values, or uses ``not``."""
    from lmplug.interfaces.constraint import ConstraintError

    if spec.kind != "json":
        return
    # iterative: a deep schema must not recurse; ``names``: a map of names to schemas (properties)
    stack: list[tuple[Any, int, bool]] = [(spec.json, 1, False)]
    while stack:
        node, depth, names = stack.pop()
        if depth > max_depth:
            raise ConstraintError("json", f"structured output json: the schema nests deeper than "
                                  f"constraint.max_schema_depth = {max_depth}; refused")
        if isinstance(node, dict) and names:
            stack.extend((v, depth, False) for v in node.values())
        elif isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > max_enum:
                raise ConstraintError("json", f"structured output json: an enum of {len(enum)} values, more "
                                      f"than constraint.max_enum_values = {max_enum}; refused")
            if "not" in node:
                raise ConstraintError("json", "structured output json: the schema keyword 'not' is not "
                                      "supported by the constraint backends; refused")
            stack.extend((v, depth + 1, k in NAME_MAPS) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, False) for v in node)


def check_satisfiable(backend: ConstraintBackend, spec: StructuredOutput, compiled: Any) -> None:
    """Raise ``ConstraintError`` if a fresh matcher of ``compiled`` allows no token but EOS and the
    empty output is not a match: no string satisfies the constraint."""
    from lmplug.interfaces.constraint import ConstraintError, bitmask_to_bool, new_bitmask

    vocab_size = backend.tokenizer.vocab_size
    matcher = backend.matcher(compiled)
    row = new_bitmask(1, vocab_size)
    row.zero_()
    try:
        matcher.fill_mask(row[0])
    except ConstraintError as exc:  # the engine stopped at one of its own limits before any token
        raise ConstraintError(spec.kind, f"structured output {spec.kind}: {exc}") from None
    allowed = bitmask_to_bool(row, vocab_size)[0]
    for stop in backend.tokenizer.eos_token_ids:
        if 0 <= stop < vocab_size:
            allowed[stop] = False
    if not bool(allowed.any()) and not matcher.is_complete():
        raise ConstraintError(spec.kind, f"structured output {spec.kind}: no string satisfies this "
                              f"constraint ({backend.name} allows no first token); refused")
