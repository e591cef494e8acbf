"""``ConstraintConformance``: every output a constraint backend allows matches the constraint.

Random walks (``constraint_walk.walk``: seeded random tokens among those the mask allows, to
EOS) through a JSON schema with nested objects, arrays, enums, number bounds, optional
properties and ``$defs``, any JSON object, regular expressions, choices and a GBNF grammar; each
walk's text is checked by ``jsonschema``, ``json``, ``re.fullmatch``, set membership or Python's
``ast``. At every step of every walk: no id past the tokenizer's vocabulary, no control token but
EOS, EOS allowed exactly when ``is_complete()``, and every allowed token accepted. Besides:
``rollback(n)`` restores the exact mask, a refused token leaves the state unchanged, bad
schemas / regexes / grammars raise ``ConstraintError`` naming the field, equal specs share one
compiled object, and matchers are independent and usable from another thread.

The tokenizer is the ``constraint_tokenizer`` fixture: a tiny byte-level BPE by default
(``constraint_walk.tiny_tokenizer``); override the fixture to run the suite on yours::

    class TestMine(ConstraintConformance):
        backend = "mine"

        @pytest.fixture(scope="class")
        @classmethod
        def constraint_tokenizer(cls):
            return ConstraintTokenizer(my_tokenizers_tokenizer, vocab_size, frozenset({eos_id}))
"""

from __future__ import annotations

import ast
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest

from lmplug.interfaces.constraint import ConstraintError, ConstraintTokenizer, StructuredOutput
from lmplug.testing.base import Conformance
from lmplug.testing.compare import ContractViolation, fail, reported
from lmplug.testing.constraint_hostile import ConstraintHostile
from lmplug.testing.constraint_walk import (
    Vocab,
    allowed_ids,
    check_mask,
    mask_of,
    tiny_tokenizer,
    walk,
)

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 99},
                   "y": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
SCHEMA = {
    "$defs": {"point": POINT},
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "kind": {"enum": ["cat", "dog", 3, None]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "origin": {"$ref": "#/$defs/point"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
        "meta": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 5}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "origin"],
    "additionalProperties": False,
}
REGEXES = (
    r"[a-z]{2,6}-[0-9]{1,3}(\.[0-9]{2})?",
    r"(yes|no|maybe)!?",
    r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]",  # not \d: engines and re disagree on Unicode digits
    r"(ab|c)+",
)
CHOICES = ("yes", "no", "nope", 'a "quoted" \\ word', "two\nlines", "(x)|y*.+", "héllo 日本")
# sums and differences of 1-3 digit numbers, with parentheses: checked with Python's own parser
GRAMMAR = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]? [0-9]?
"""
BAD = {
    "json": [{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}],
    "regex": ["a(b", "[z-a]"],
    "grammar": ['root ::= "a" undefined_rule', 'root ::= "unterminated'],
}


class ConstraintConformance(ConstraintHostile, Conformance):
    family = "constraint"
    walks: ClassVar[int] = 6  # random walks per constraint
    max_steps: ClassVar[int] = 200  # a walk that has not reached EOS by then fails
    seed: ClassVar[int] = 0

    @pytest.fixture(scope="class")
    @classmethod
    def constraint_tokenizer(cls) -> ConstraintTokenizer:
        """The tokenizer the suite runs on; override it to use your own."""
        return tiny_tokenizer()

    @pytest.fixture(scope="class")
    @classmethod
    def vocab(cls, constraint_tokenizer) -> Vocab:
        return Vocab(constraint_tokenizer)

    @pytest.fixture(scope="class")
    @classmethod
    def constraint_backend(cls, backend_class, backend_options, constraint_tokenizer):
        with reported(cls.label()):
            return backend_class(backend_options, constraint_tokenizer)

    def compiled(self, constraint_backend, spec: StructuredOutput):
        with reported(f"{self.label()}, compiling {spec.kind}"):
            return constraint_backend.compile_cached(spec)

    def texts(self, constraint_backend, vocab: Vocab, spec: StructuredOutput, what: str,
              closing: str = "") -> list[str]:
        """The decoded texts of ``walks`` seeded random walks through ``spec``."""
        compiled = self.compiled(constraint_backend, spec)
        rng = random.Random(self.seed)
        # any whitespace between JSON tokens: random walks spend most steps on it
        steps = self.max_steps * (4 if spec.whitespace_flexible else 1)
        out = []
        for i in range(self.walks):
            with reported(self.label()):
                ids = walk(constraint_backend, compiled, vocab, rng, steps, f"{self.label()}, {what}, walk {i}",
                           closing)
            out.append(vocab.decode(ids))
        return out

    # -- every output matches ---------------------------------------------------------------------
    @pytest.mark.parametrize("flexible", [False, True], ids=["compact", "any_whitespace"])
    def test_json_schema_walks_validate(self, constraint_backend, vocab, flexible: bool) -> None:
        jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a dev dependency) validates "
                                         "the walks through a JSON schema; it is not installed")
        spec = StructuredOutput(json=SCHEMA, whitespace_flexible=flexible)
        for text in self.texts(constraint_backend, vocab, spec, "json schema", closing='"]}'):
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
            except (ValueError, jsonschema.ValidationError) as exc:
                fail(f"{self.label()}: a walk through the JSON schema gave {text!r}, which does not "
                     f"validate: {str(exc).splitlines()[0]}")

    def test_json_object_walks_are_objects(self, constraint_backend, vocab) -> None:
        for text in self.texts(constraint_backend, vocab, StructuredOutput(json_object=True), "json_object",
                               closing='"]}'):
            try:
                value = json.loads(text)
            except ValueError as exc:
                fail(f"{self.label()}: a walk through json_object gave {text!r}, not JSON: {exc}")
            if not isinstance(value, dict):
                fail(f"{self.label()}: a walk through json_object gave {text!r}, not an object")

    @pytest.mark.parametrize("pattern", REGEXES)
    def test_regex_walks_fullmatch(self, constraint_backend, vocab, pattern: str) -> None:
        for text in self.texts(constraint_backend, vocab, StructuredOutput(regex=pattern), f"regex {pattern!r}"):
            if re.fullmatch(pattern, text) is None:
                fail(f"{self.label()}: a walk through regex {pattern!r} gave {text!r}, which does not match")

    def test_choice_walks_are_choices(self, constraint_backend, vocab) -> None:
        for text in self.texts(constraint_backend, vocab, StructuredOutput(choice=CHOICES), "choice"):
            if text not in CHOICES:
                fail(f"{self.label()}: a walk through choice {CHOICES!r} gave {text!r}, not one of them")

    def test_grammar_walks_parse(self, constraint_backend, vocab) -> None:
        for text in self.texts(constraint_backend, vocab, StructuredOutput(grammar=GRAMMAR), "grammar",
                               closing=")"):
            problem = _arithmetic_problem(text)
            if problem:
                fail(f"{self.label()}: a walk through the GBNF grammar\n{GRAMMAR}\ngave {text!r}: {problem}")

    # -- the matcher's state ----------------------------------------------------------------------
    def test_rollback_restores_mask(self, constraint_backend, vocab) -> None:
        """Masks after rollback(n) equal the masks first seen at that position, including after EOS."""
        compiled = self.compiled(constraint_backend, StructuredOutput(json=SCHEMA))
        rng = random.Random(self.seed + 1)
        with reported(self.label()):
            ids = walk(constraint_backend, compiled, vocab, rng, self.max_steps, f"{self.label()}, rollback walk")
            tokens = [*ids, min(vocab.eos & set(allowed_after(constraint_backend, compiled, vocab, ids)))]
            matcher = constraint_backend.matcher(compiled)
            masks = [mask_of(matcher, vocab.tok.vocab_size)]
            for t in tokens:
                if not matcher.accept(t):
                    raise ContractViolation(f"{self.label()}: replaying a walk, accept({t}) was refused")
                masks.append(mask_of(matcher, vocab.tok.vocab_size))
            position = len(tokens)
            for n in (1, 2, 3, 5, len(tokens) // 2):
                n = min(n, position)
                matcher.rollback(n)
                position -= n
                where = f"{self.label()}: after rollback({n}) to position {position} of {len(tokens)}"
                if matcher.is_terminated():
                    raise ContractViolation(f"{where}: is_terminated() is still True")
                got = mask_of(matcher, vocab.tok.vocab_size)
                if not bool((got == masks[position]).all()):
                    diff = (got != masks[position]).nonzero().flatten().tolist()
                    raise ContractViolation(f"{where}: the mask differs from the one first seen there "
                                            f"at ids {diff[:8]}")
                for t in tokens[position:position + 2]:  # forward again: the same masks follow
                    if not matcher.accept(t):
                        raise ContractViolation(f"{where}: accept({t}) refused on replay")
                    position += 1
                    if not bool((mask_of(matcher, vocab.tok.vocab_size) == masks[position]).all()):
                        raise ContractViolation(f"{where}: replaying token {t} gave a different mask")

    def test_refused_token_leaves_state(self, constraint_backend, vocab) -> None:
        """accept() of a forbidden id returns False and changes nothing; the matcher goes on."""
        compiled = self.compiled(constraint_backend, StructuredOutput(json=SCHEMA))
        prefix = vocab.encode('{"name": "ab')
        with reported(self.label()):
            matcher = constraint_backend.matcher(compiled)
            for depth, token in enumerate([None, *prefix]):
                if token is not None and not matcher.accept(token):
                    raise ContractViolation(f"{self.label()}: accept({token}) refused while encoding "
                                            f"{vocab.decode(prefix)!r} (any tokenization must be accepted)")
                before = mask_of(matcher, vocab.tok.vocab_size)
                complete = matcher.is_complete()
                forbidden = (~before[: vocab.size]).nonzero().flatten().tolist()
                probes = [*forbidden[:: max(1, len(forbidden) // 6)], *sorted(vocab.control), *sorted(vocab.eos),
                          vocab.tok.vocab_size - 1, vocab.tok.vocab_size, -1]
                for probe in probes:
                    if 0 <= probe < vocab.tok.vocab_size and before[probe]:
                        continue
                    where = f"{self.label()}: after {vocab.decode(prefix[:depth])!r}, accept({probe})"
                    if matcher.accept(probe):
                        raise ContractViolation(f"{where} returned True for a token the mask forbids")
                    if not bool((mask_of(matcher, vocab.tok.vocab_size) == before).all()) \
                            or matcher.is_complete() != complete:
                        raise ContractViolation(f"{where} returned False but changed the matcher's state")
            rest = vocab.encode('", "kind": 3, "origin": {"x": 7, "y": 0}}')
            for t in rest:
                if not matcher.accept(t):
                    raise ContractViolation(f"{self.label()}: after refused tokens, the matcher refused "
                                            f"{vocab.tok.tokenizer.id_to_token(t)!r} of a valid continuation")
            if not matcher.is_complete():
                raise ContractViolation(f"{self.label()}: a complete valid object, but is_complete() is False")

    def test_eos_only_when_complete(self, constraint_backend, vocab) -> None:
        compiled = self.compiled(constraint_backend, StructuredOutput(regex="abc(de)?"))
        with reported(self.label()):
            matcher = constraint_backend.matcher(compiled)
            eos = min(vocab.eos)
            for i, token in enumerate(vocab.encode("abcde")):
                text = vocab.decode(vocab.encode("abcde")[:i])
                check_mask(allowed_ids(matcher, vocab.tok.vocab_size), matcher, vocab,
                           f"{self.label()}, regex 'abc(de)?' after {text!r}")
                if matcher.is_complete() != (text in ("abc", "abcde")):
                    raise ContractViolation(f"{self.label()}: regex 'abc(de)?' after {text!r}: "
                                            f"is_complete() is {matcher.is_complete()}")
                if not matcher.is_complete() and matcher.accept(eos):
                    raise ContractViolation(f"{self.label()}: EOS accepted after {text!r}, which is incomplete")
                if not matcher.accept(token):
                    raise ContractViolation(f"{self.label()}: accept({token}) refused on 'abcde'")
            if not matcher.is_complete() or not matcher.accept(eos) or not matcher.is_terminated():
                raise ContractViolation(f"{self.label()}: after 'abcde' EOS must be accepted and terminate")
            if matcher.accept(vocab.encode("a")[0]):
                raise ContractViolation(f"{self.label()}: a token accepted after EOS")

    def test_matchers_independent_and_threadable(self, constraint_backend, vocab) -> None:
        """Two matchers of one compiled constraint share no state; fill_mask works on another thread."""
        compiled = self.compiled(constraint_backend, StructuredOutput(choice=("alpha", "beta")))
        with reported(self.label()):
            a, b = constraint_backend.matcher(compiled), constraint_backend.matcher(compiled)
            fresh = mask_of(b, vocab.tok.vocab_size)
            for t in vocab.encode("alpha"):
                a.accept(t)
            if not a.is_complete() or b.is_complete() or not bool((mask_of(b, vocab.tok.vocab_size) == fresh).all()):
                raise ContractViolation(f"{self.label()}: advancing one matcher changed another of the same "
                                        "compiled constraint")
            with ThreadPoolExecutor(2) as pool:
                there = pool.submit(mask_of, b, vocab.tok.vocab_size).result()
            if not bool((there == fresh).all()):
                raise ContractViolation(f"{self.label()}: fill_mask on a worker thread gave a different mask")

    # -- compiling ----------------------------------------------------------------------------------
    @pytest.mark.parametrize("kind, bad", [(k, v) for k, vs in BAD.items() for v in vs],
                             ids=[f"{k}{i}" for k, vs in BAD.items() for i in range(len(vs))])
    def test_bad_spec_raises_constraint_error(self, constraint_backend, kind: str, bad) -> None:
        spec = StructuredOutput(**{kind: bad})
        try:
            constraint_backend.compile_cached(spec)
        except ConstraintError as exc:
            if exc.field != kind:
                fail(f"{self.label()}: a bad {kind} raised ConstraintError with field {exc.field!r}, "
                     f"expected {kind!r}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - the check is which error
            fail(f"{self.label()}: a bad {kind} {bad!r} raised {type(exc).__name__}: {exc} "
                 "(expected ConstraintError naming the field)")
        fail(f"{self.label()}: a bad {kind} {bad!r} compiled without error; expected ConstraintError "
             "at compile, so the request fails at admission")

    def test_compile_cached_shares_equal_specs(self, constraint_backend) -> None:
        with reported(self.label()):
            first = constraint_backend.compile_cached(StructuredOutput(json=SCHEMA))
            again = constraint_backend.compile_cached(StructuredOutput(json=json.dumps(SCHEMA, indent=2)))
            other = constraint_backend.compile_cached(StructuredOutput(json=SCHEMA, whitespace_flexible=True))
            with ThreadPoolExecutor(4) as pool:
                parallel = list(pool.map(lambda _: constraint_backend.compile_cached(StructuredOutput(regex="x+y")), range(4)))
            kept = constraint_backend.compile_cached(StructuredOutput(regex="x+y"))
        if first is not again:
            fail(f"{self.label()}: compile_cached gave two objects for one schema (as a dict, then as text)")
        if other is first:
            fail(f"{self.label()}: compile_cached gave one object for different whitespace layouts")
        if not any(kept is p for p in parallel) or constraint_backend.compile_cached(StructuredOutput(regex="x+y")) is not kept:
            fail(f"{self.label()}: after compiling one regex from 4 threads, compile_cached does not return "
                 "one of their results from then on")

    def test_cache_is_bounded_in_bytes(self, backend_class, backend_options, constraint_tokenizer) -> None:
        """``cache_bytes`` bounds the cache by the backend's ``size_bytes``: a budget of one entry
        keeps only the latest; one past the budget is returned, not kept."""
        specs = [StructuredOutput(choice=tuple(f"{k}-{i}" for i in range(64))) for k in range(3)]
        with reported(self.label()):
            probe = backend_class(backend_options, constraint_tokenizer)
            size = probe.size_bytes(probe.compile_cached(specs[0]))
            if size <= 0:  # the backend reports no sizes: the entry bound alone applies
                return
            backend = backend_class(backend_options.model_copy(update={"cache_bytes": size + size // 2}),
                                    constraint_tokenizer)
            for spec in specs:
                backend.compile_cached(spec)
            held = [spec for spec in specs if backend.cached(spec) is not None]
            small = backend_class(backend_options.model_copy(update={"cache_bytes": size // 2}), constraint_tokenizer)
            compiled = small.compile_cached(specs[0])
        if held != specs[-1:]:
            fail(f"{self.label()}: with cache_bytes for one entry the cache holds {len(held)} of 3")
        if compiled is None or small.cached(specs[0]) is not None:
            fail(f"{self.label()}: an entry larger than cache_bytes was kept (or not returned)")


def allowed_after(backend, compiled, vocab: Vocab, ids: list[int]) -> list[int]:
    matcher = backend.matcher(compiled)
    for t in ids:
        matcher.accept(t)
    return allowed_ids(matcher, vocab.tok.vocab_size)


def _arithmetic_problem(text: str) -> str | None:
    """Why ``text`` is not a sum/difference of 1-3 digit numbers with parentheses, or None."""
    if re.fullmatch(r"[0-9()+\-]+", text) is None:
        return "characters outside digits, parentheses, + and -"
    if re.search(r"(?<![0-9])0|[0-9]{4}", text):
        return "a number with a leading zero or more than 3 digits"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        return f"not an expression: {exc.msg}"
    for node in ast.walk(tree.body):
        if isinstance(node, ast.UnaryOp) or not isinstance(
                node, (ast.BinOp, ast.Constant, ast.Add, ast.Sub)) \
                or (isinstance(node, ast.BinOp) and not isinstance(node.op, (ast.Add, ast.Sub))):
            return f"contains {type(node).__name__}"
    return None
