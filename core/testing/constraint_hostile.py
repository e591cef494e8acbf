"""Hostile constraints every constraint backend must handle the same way (issue 45's probe cases).

Refused at compile with a ``ConstraintError`` naming the field: JSON text nested past Python's
decoder (``"[" * 5000``), schemas nested past ``max_schema_depth`` or with an enum past
``max_enum_values``, ``{"not": {}}`` (no backend implements ``not``), and constraints no string
satisfies (``root ::= root``, a ``$ref`` to itself), and counted repetitions past ``max_repeat``
(``(a{1000}){1000}``, ``root ::= "a"{1000000000}``: the backends' own limits differ, so the shared
check refuses both the same way). Compiled and walkable without the matcher refusing a token its
own mask allowed: 4,096 long choices; every allowed token keeps the output a prefix of a match. A backend may instead stop with a ``ConstraintError`` naming one of its own
limits (llguidance's parser limits), at admission or at the step it is hit: a clear error, never a
refused token that reads as "the matcher and the output diverged".
"""

from __future__ import annotations

import random

import pytest

from lmplug.interfaces.constraint import ConstraintError, StructuredOutput
from lmplug.testing.compare import fail
from lmplug.testing.constraint_walk import allowed_ids


def _deep_array(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


REFUSED = {
    "bracket_text": ("json", "[" * 5000),
    "deep_schema": ("json", _deep_array(490)),
    "big_enum": ("json", {"enum": [f"value-{i}" for i in range(110_000)]}),
    "not_anything": ("json", {"not": {}}),
    "self_ref": ("json", {"$ref": "#"}),
    "root_root": ("grammar", "root ::= root"),
    "nested_repeat": ("regex", "(a{1000}){1000}"),
    "huge_repeat": ("grammar", 'root ::= "a"{1000000000}'),
}
LONG_CHOICES = tuple(f"option number {i} " + "x" * 40 for i in range(4096))
HARD = {
    "repeat_at_limit": (StructuredOutput(regex="(a{100}){100}"), "a"),
    "long_choices": (StructuredOutput(choice=LONG_CHOICES), None),
}


class ConstraintHostile:
    """Mixed into ``ConstraintConformance`` (which supplies the fixtures and ``label``)."""

    hostile_steps = 60  # tokens walked through each hard constraint

    @pytest.mark.parametrize("case", sorted(REFUSED))
    def test_hostile_spec_refused(self, constraint_backend, case: str) -> None:
        kind, value = REFUSED[case]
        try:
            constraint_backend.compile_cached(StructuredOutput(**{kind: value}))
        except ConstraintError as exc:
            if exc.field != kind:
                fail(f"{self.label()}: {case} raised ConstraintError naming {exc.field!r}, expected {kind!r}")
            return
        except Exception as exc:  # noqa: BLE001 - the check is which error
            fail(f"{self.label()}: {case} raised {type(exc).__name__}: {exc} (expected ConstraintError)")
        fail(f"{self.label()}: {case} compiled; expected a ConstraintError naming {kind!r} at admission")

    @pytest.mark.parametrize("case", sorted(HARD))
    def test_hard_spec_walks_without_divergence(self, constraint_backend, vocab, case: str) -> None:
        spec, letters = HARD[case]
        try:
            matcher = constraint_backend.matcher(constraint_backend.compile_cached(spec))
        except ConstraintError as exc:  # refused at admission, naming the engine's limit: allowed
            if exc.field != spec.kind or "limit" not in str(exc):
                fail(f"{self.label()}: {case}: refused without naming the field and a limit: {exc}")
            return
        try:
            ids = self._hard_walk(constraint_backend, vocab, matcher, case)
        except ConstraintError as exc:  # a clear error naming the engine's limit is allowed
            if "limit" not in str(exc):
                fail(f"{self.label()}: {case}: the walk raised an error not naming a limit: {exc}")
            return
        text = vocab.decode(ids)
        ok = set(text) <= {letters} if letters else any(c.startswith(text) for c in spec.choice)
        if not ids or not ok:
            fail(f"{self.label()}: {case}: the walk {text[:80]!r} is not a prefix of a match")

    def _hard_walk(self, constraint_backend, vocab, matcher, case: str) -> list[int]:
        """Seeded random tokens among those each mask allows; fails on a refused allowed token."""
        rng, ids = random.Random(0), []
        stops = constraint_backend.tokenizer.eos_token_ids
        for _ in range(self.hostile_steps):
            allowed = [t for t in allowed_ids(matcher, vocab.tok.vocab_size) if t not in stops]
            if not allowed:
                break
            token = rng.choice(allowed)
            if not matcher.accept(token):
                fail(f"{self.label()}: {case}: token {token} allowed by the mask was refused by accept "
                     "(the matcher and the output would diverge)")
            ids.append(token)
        return ids
