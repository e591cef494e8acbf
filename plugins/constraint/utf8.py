"""Keeping a byte-level grammar engine's output valid UTF-8.

xgrammar (0.2.9) matches characters byte by byte but accepts byte sequences that are not UTF-8:
a surrogate (``ED A0..BF ..``), for one, passes ``[^a]`` or a JSON string. The tokens of a
byte-level vocabulary can spell any byte, so a walk through such a grammar can decode to
replacement characters. ``Utf8Guard`` knows each token's bytes and, for the unfinished
character at the end of the output so far (``pending``), which tokens continue it validly;
the matcher ANDs that into every mask and refuses other tokens in ``accept``. The check is
Python's strict UTF-8 decoder.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# representative pending bytes for "n continuation bytes still needed, any 80..BF next"
_GENERIC = {1: b"\xe1\x80", 2: b"\xf1\x80"}


def _needed(lead: int) -> int:
    return 1 if 0xC0 <= lead < 0xE0 else 2 if 0xE0 <= lead < 0xF0 else 3 if lead >= 0xF0 else 0


def incomplete_tail(data: bytes) -> bytes:
    """The bytes of an unfinished last character of ``data`` (valid UTF-8 so far), or b""."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80 or byte >= 0xC0:  # ASCII or a lead byte
            return data[-back:] if byte >= 0xC0 and _needed(byte) >= back else b""
    return b""


def _key(pending: bytes) -> bytes:
    """Pendings that allow the same next tokens share a key (only a lone lead byte narrows the
    range of the next byte: E0, ED, F0, F4)."""
    if len(pending) <= 1:
        return pending
    return _GENERIC[_needed(pending[0]) + 1 - len(pending)]


def _valid(data: bytes) -> bool:
    """``data`` is UTF-8 up to an unfinished last character that some bytes could complete.
    (Python's incremental decoder accepts ``ED A0`` until the third byte, so the last character
    is completed with the smallest continuation bytes and decoded strictly.)"""
    tail = incomplete_tail(data)
    missing = _needed(tail[0]) + 1 - len(tail) if tail else 0
    firsts = (0x80, 0x90, 0xA0) if len(tail) == 1 else (0x80,)  # E0 needs A0.., F0 90..
    for first in firsts if missing else (None,):
        pad = bytes([first]) + b"\x80" * (missing - 1) if missing else b""
        try:
            (data + pad).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False


class Utf8Guard:
    """Per tokenizer: which tokens may follow each unfinished character, as bitmask words."""

    def __init__(self, token_bytes: list[bytes], words: int) -> None:
        self.token_bytes = token_bytes
        self.words = words
        self._masks: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def words_after(self, pending: bytes) -> torch.Tensor:
        """int32 [words]: the tokens whose bytes continue ``pending`` as valid UTF-8 (empty
        tokens, i.e. special ones, included: the grammar decides about those)."""
        key = _key(pending)
        with self._lock:
            cached = self._masks.get(key)
        if cached is None:
            bits = np.array([_valid(key + b) for b in self.token_bytes], dtype=bool)
            packed = np.zeros(self.words * 4, dtype=np.uint8)
            raw = np.packbits(bits, bitorder="little")
            packed[: raw.size] = raw
            cached = torch.from_numpy(packed.view("<i4").copy())
            with self._lock:
                self._masks[key] = cached
        return cached

    def allows(self, pending: bytes, token: int) -> bool:
        return _valid(_key(pending) + self.token_bytes[token])

    def advance(self, pending: bytes, token: int) -> bytes:
        return incomplete_tail(pending + self.token_bytes[token])
