"""What both grammar engines need to know about the model's ``tokenizers.Tokenizer``.

Grammar engines match text, so every token needs its text; control tokens (``<|im_start|>``,
``</s>``, ...) have text too, but the model must never emit one inside constrained output — a
JSON string containing ``<|im_start|>`` would decode to something else, or open a chat turn.
``special_ids`` names them so the backends can forbid them (EOS excepted: it ends the output).
"""

from __future__ import annotations

import json
from typing import Any

from lmplug.api import ConstraintTokenizer


def tokenizer_size(tokenizer: Any) -> int:
    """Ids the tokenizer itself knows (its vocabulary plus added tokens)."""
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the added tokens marked special (control tokens)."""
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


def stop_ids(tok: ConstraintTokenizer) -> list[int]:
    """The EOS ids the logits can hold, sorted; a constraint cannot end without one."""
    ids = sorted(i for i in tok.eos_token_ids if 0 <= i < tok.vocab_size)
    if not ids:
        raise ValueError(f"the tokenizer names no EOS token below the model's vocab_size {tok.vocab_size} "
                         f"(eos_token_ids = {sorted(tok.eos_token_ids)}): constrained output could never end")
    return ids


def tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer's JSON without padding or truncation (engines tokenize text with it)."""
    data = json.loads(tokenizer.to_str())
    data["padding"] = None
    data["truncation"] = None
    return json.dumps(data)


def byte_level_spelling(text: str) -> str:
    """``text`` in GPT-2's byte alphabet (how a byte-level vocabulary spells its tokens)."""
    return "".join(BYTE_ALPHABET[b] for b in text.encode("utf-8"))


def _byte_alphabet() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_ALPHABET = _byte_alphabet()


def allow_only(row: Any, ids: list[int]) -> None:
    """Set a bitmask row (int32 words) to allow exactly ``ids``."""
    row.zero_()
    for t in ids:
        row[t // 32] |= -(1 << 31) if t % 32 == 31 else 1 << (t % 32)  # bit 31 is the sign bit
