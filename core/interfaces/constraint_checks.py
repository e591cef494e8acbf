"""Checks of a constraint before and after it is compiled, shared by every constraint backend.

Before: a constraint's text length (``max_grammar_chars``), a JSON schema's nesting depth and enum
sizes and a choice's count (``max_schema_depth``, ``max_enum_values``) are bounded, so a hostile schema is refused with an error naming the limit instead of
running the grammar engine (and Python's recursion) for seconds. ``not`` is refused: no backend
implements it (xgrammar ignores it, so ``{"not": {}}`` would produce JSON that violates it).

After: a constraint that no string satisfies (``root ::= root``, a ``$ref`` to itself) leaves a
fresh matcher with no token but EOS allowed while it is not complete; such a constraint is
refused at admission, where generating would only end in an empty "stop" or a step error.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmplug.interfaces.constraint import ConstraintBackend, ConstraintOptions, StructuredOutput

_COUNT = re.compile(r"\{\s*(\d{1,12})\s*(?:,\s*(\d{0,12})\s*)?\}")
NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def check_before_compile(spec: StructuredOutput, options: ConstraintOptions) -> None:
    """Raise ``ConstraintError`` naming the limit if ``spec``'s text is longer than
    ``max_grammar_chars``, its choice or a JSON schema enum lists more than ``max_enum_values``, its
    JSON schema nests deeper than ``max_schema_depth`` or uses ``not``."""
    from lmplug.interfaces.constraint import ConstraintError

    max_depth, max_enum = options.max_schema_depth, options.max_enum_values
    chars = spec_chars(spec)
    if chars > options.max_grammar_chars:
        raise ConstraintError(spec.kind, f"structured output {spec.kind}: {chars} characters, more than "
                              f"structured_output.max_grammar_chars = {options.max_grammar_chars}; refused")
    if spec.kind == "choice" and len(spec.choice) > max_enum:
        raise ConstraintError("choice", f"structured output choice: {len(spec.choice)} choices, more than "
                              f"structured_output.max_enum_values = {max_enum}; refused")
    if spec.kind in ("regex", "grammar"):
        repeat = repeat_product(spec.regex if spec.kind == "regex" else spec.grammar)
        if repeat > options.max_repeat:
            raise ConstraintError(spec.kind, f"structured output {spec.kind}: counted repetitions that nest to "
                                  f"{repeat} copies, past the limit structured_output.max_repeat = "
                                  f"{options.max_repeat}; refused")
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


def repeat_product(text: str) -> int:
    """The most copies a counted repetition (``x{n}``, ``x{n,m}``, ``x{n,}``) asks for, its count
    times those of the groups around it: ``(a{1000}){1000}`` is 1,000,000. Quoted strings, character
    classes and escapes are skipped (GBNF and regex alike)."""
    opened: list[int] = []  # start of each open group
    groups: list[tuple[int, int]] = []  # (start, end) of closed groups
    counts: list[tuple[int, int, int]] = []  # (start, end, count): what a repetition covers
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c in "\"'[":
            close = "]" if c == "[" else c
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "(":
            opened.append(i)
        elif c == ")" and opened:
            groups.append((opened.pop(), i))
        elif c == "{":
            match = _COUNT.match(text, i)
            if match:
                count = max(int(g) for g in match.groups() if g)
                start = groups[-1][0] if groups and groups[-1][1] == i - 1 else i - 1
                counts.append((start, i, count))
                i = match.end()
                continue
        i += 1
    most = 1
    for start, end, count in counts:
        for outer_start, outer_end, outer in counts:
            if outer_start < start and end < outer_end:
                count *= outer
        most = max(most, count)
    return most


def spec_chars(spec: StructuredOutput) -> int:
    """The length of a constraint's text (all choices together)."""
    if spec.kind == "choice":
        return sum(len(c) for c in spec.choice)
    return len({"json": spec.schema_text, "regex": spec.regex or "", "grammar": spec.grammar or ""}.get(spec.kind, ""))


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
