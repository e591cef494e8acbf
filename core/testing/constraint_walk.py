"""Random walks through a constraint's masks, and the tiny tokenizer the constraint suite defaults to.

A walk starts a matcher, and at every step fills its mask, checks the mask (no id past the
tokenizer's vocabulary, no control token but EOS, EOS allowed exactly when ``is_complete()``, at
least one token allowed), then picks an allowed token with a seeded generator and accepts it.
When EOS is allowed it is taken with probability 1/2 (always when nothing else is allowed), so
walks end after a bounded number of steps for any constraint whose language is finite or whose
loops can exit. The decoded text is then checked against the constraint by the suite, with tools
nobody here wrote (``jsonschema``, ``re``, ``ast``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lmplug.interfaces.constraint import (
    ConstraintBackend,
    ConstraintTokenizer,
    Matcher,
    bitmask_to_bool,
    new_bitmask,
)
from lmplug.testing.compare import ContractViolation

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; EOS is <|im_end|>
CORPUS = [
    '{"name": "fox", "age": 12, "tags": ["a", "b"], "ok": true, "next": null}',
    '[{"x": 1, "y": -2.5}, {"x": 30, "y": 4e3}]',
    "The quick brown fox jumps over the lazy dog. yes no maybe 2024-01-31 a1b2",
    "def f(x):\n    return (x + 1) * 2 - 3\n",
    "héllo wörld, 日本語 🎉 \\ \" ' \t tab",
]
PADDING = 5  # logits rows past the tokenizer's vocabulary, as a padded LM head has


def tiny_tokenizer() -> ConstraintTokenizer:
    """A byte-level BPE (GPT-2 style, about 330 tokens) trained on ``CORPUS``, with three control
    tokens and an LM head ``PADDING`` rows wider than the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS * 5, trainer)
    return ConstraintTokenizer(tk, tk.get_vocab_size(with_added_tokens=True) + PADDING,
                               frozenset({tk.token_to_id("<|im_end|>")}))


@dataclass
class Vocab:
    """What the checks need to know of a ``ConstraintTokenizer``."""

    tok: ConstraintTokenizer

    def __post_init__(self) -> None:
        self.size = self.tok.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos = frozenset(self.tok.eos_token_ids)
        added = self.tok.tokenizer.get_added_tokens_decoder()
        self.control = frozenset(i for i, t in added.items() if t.special) - self.eos

        # decoding after a plain token: a SentencePiece decoder strips the space of the first
        # piece, which the model's output (decoded after the prompt) keeps
        self._ref = self.tok.tokenizer.encode("a", add_special_tokens=False).ids[-1]
        self._ref_text = self.tok.tokenizer.decode([self._ref], skip_special_tokens=False)
        self._texts: dict[int, str] | None = None

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` as it reads in the middle of an output."""
        text = self.tok.tokenizer.decode([self._ref, *ids], skip_special_tokens=False)
        return text[len(self._ref_text):]

    def piece(self, token: int) -> str:
        """One token's text in the middle of an output ("" for control tokens and EOS)."""
        if self._texts is None:
            self._texts = {t: self.decode([t]) for t in range(self.size) if t not in self.control | self.eos}
        return self._texts.get(token, "")

    def encode(self, text: str) -> list[int]:
        """A tokenization of ``text`` (greedy longest pieces, no control tokens): any tokenization
        of an allowed text must be accepted, and this one has no SentencePiece leading space."""
        self.piece(0)
        by_text: dict[str, int] = {}
        for t, piece in self._texts.items():
            if piece and "\ufffd" not in piece:
                by_text.setdefault(piece, t)
        ids, at = [], 0
        while at < len(text):
            piece = next((text[at:end] for end in range(len(text), at, -1) if text[at:end] in by_text), None)
            if piece is None:
                raise ValueError(f"no token spells {text[at:]!r}")
            ids.append(by_text[piece])
            at += len(piece)
        return ids


def allowed_ids(matcher: Matcher, vocab_size: int) -> list[int]:
    row = new_bitmask(1, vocab_size)
    row.zero_()
    matcher.fill_mask(row[0])
    return bitmask_to_bool(row, vocab_size)[0].nonzero().flatten().tolist()


def mask_of(matcher: Matcher, vocab_size: int) -> torch.Tensor:
    row = new_bitmask(1, vocab_size)
    row.zero_()
    matcher.fill_mask(row[0])
    return bitmask_to_bool(row, vocab_size)[0]


def check_mask(allowed: list[int], matcher: Matcher, vocab: Vocab, where: str) -> None:
    """The rules every mask keeps, whatever the constraint."""
    if not allowed:
        raise ContractViolation(f"{where}: the mask allows no token at all (the row could not be sampled)")
    past = [t for t in allowed if t >= vocab.size]
    if past:
        raise ContractViolation(f"{where}: the mask allows ids {past[:8]} past the tokenizer's vocabulary "
                                f"({vocab.size} tokens; the logits have {vocab.tok.vocab_size})")
    control = sorted(set(allowed) & vocab.control)
    if control:
        raise ContractViolation(f"{where}: the mask allows control tokens {control[:8]} "
                                f"({[vocab.tok.tokenizer.id_to_token(t) for t in control[:4]]}); "
                                "only EOS may be allowed among special tokens")
    eos_allowed = bool(vocab.eos & set(allowed))
    if eos_allowed != matcher.is_complete():
        raise ContractViolation(f"{where}: EOS {'is' if eos_allowed else 'is not'} allowed but "
                                f"is_complete() is {matcher.is_complete()}")


def walk(backend: ConstraintBackend, compiled, vocab: Vocab, rng: random.Random, max_steps: int,
         where: str, closing: str = "") -> list[int]:
    """One random walk to EOS; the tokens before EOS. ``closing``: characters that end the
    constraint's open parts (e.g. ``"]}`` for JSON); tokens spelled only with them are picked
    with probability 1/2 when allowed, so walks through unbounded languages end."""
    matcher = backend.matcher(compiled)
    ids: list[int] = []
    for step in range(max_steps):
        at = f"{where}, step {step} (after {vocab.decode(ids)!r})"
        allowed = allowed_ids(matcher, vocab.tok.vocab_size)
        check_mask(allowed, matcher, vocab, at)
        eos = sorted(vocab.eos & set(allowed))
        others = [t for t in allowed if t not in vocab.eos]
        if eos and (not others or rng.random() < 0.5):
            if not matcher.accept(eos[0]):
                raise ContractViolation(f"{at}: the mask allows EOS {eos[0]} but accept() refused it")
            if not matcher.is_terminated():
                raise ContractViolation(f"{at}: EOS accepted but is_terminated() is False")
            return ids
        closers = [t for t in others if closing and vocab.piece(t) and set(vocab.piece(t)) <= set(closing)]
        token = rng.choice(closers if closers and rng.random() < 1 / 2 else others)
        if not matcher.accept(token):
            raise ContractViolation(f"{at}: the mask allows token {token} "
                                    f"({vocab.tok.tokenizer.id_to_token(token)!r}) but accept() refused it")
        ids.append(token)
    raise ContractViolation(f"{where}: no EOS after {max_steps} steps ({vocab.decode(ids)!r}); "
                            "raise max_steps if this constraint's outputs are that long")
