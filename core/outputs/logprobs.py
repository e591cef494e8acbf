"""Logprobs of emitted tokens and of prompt tokens, trimmed to what each request asked for;
each entry's ``decoded_token`` is its token's text where the engine has a tokenizer."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import lru_cache

import torch

from lmplug.interfaces.sequence import Sequence
from lmplug.kit.sampling import top_logprobs, with_text

_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder(tokenizer) -> Callable[[int], str] | None:
    """Token id -> its text (special tokens kept), cached per tokenizer; None without one."""
    if tokenizer is None:
        return None
    try:
        return _decoders[tokenizer]
    except (KeyError, TypeError):
        pass
    fn = lru_cache(maxsize=65536)(lambda tid: tokenizer.decode([tid], skip_special_tokens=False))
    try:
        _decoders[tokenizer] = fn
    except TypeError:  # not weak-referenceable: uncached across steps, still correct
        pass
    return fn


def trim(row: dict, k: int, chosen: int) -> dict:
    """The top ``k`` entries of ``row``, plus the chosen token's (it is reported whatever its rank)."""
    return {tid: lp for tid, lp in row.items() if lp.rank <= k or tid == chosen}


def _named(row: dict, decode: Callable[[int], str] | None) -> dict:
    return row if decode is None else with_text(row, decode)


def token_logprobs(logits: torch.Tensor, seqs: list[Sequence], emitted: list[list[int]],
                   rows: list[list[int]], tokenizer=None) -> list[list[dict] | None]:
    """Per sequence: one entry per emitted token (from the logits row that chose it), or None
    where the request asked for no logprobs. One ``top_logprobs`` call for the whole step; the
    entries kept are decoded (only when some request asked for logprobs)."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[list[dict] | None] = [None] * len(seqs)
    if not want:
        return out
    decode = decoder(tokenizer)
    k = max(seqs[i].params.logprobs for i in want)
    flat_rows = [r for i in want for r in rows[i]]
    chosen = torch.tensor([t for i in want for t in emitted[i]])
    entries = iter(top_logprobs(logits[flat_rows], chosen, k))
    for i in want:
        out[i] = [_named(trim(next(entries), seqs[i].params.logprobs, t), decode) for t in emitted[i]]
    return out


def record_prompt_logprobs(seq: Sequence, first: int, logits: torch.Tensor, tokenizer=None) -> None:
    """Logits at prompt position p predict token p + 1; entry 0 is None (nothing predicts it).

    Entries already recorded (before a preemption made the sequence recompute) are kept.
    """
    k = seq.params.prompt_logprobs
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)
    start = max(first, len(seq.prompt_logprobs) - 1)
    upto = min(first + logits.shape[0], seq.num_prompt_tokens - 1)
    if upto <= start:
        return
    decode = decoder(tokenizer)
    targets = torch.tensor(seq.token_ids[start + 1:upto + 1])
    rows = top_logprobs(logits[start - first:upto - first], targets, k)
    for row, tok in zip(rows, targets.tolist()):
        seq.prompt_logprobs.append(_named(trim(row, k, tok), decode))
