"""``ngram``: prompt lookup decoding — propose what followed the last n tokens before.

No model: the last ``n`` tokens of the sequence (prompt and output so far) are searched
for earlier in the sequence, longest ``n`` first (``max_n`` down to ``min_n``); at the most
recent earlier match, the tokens that followed it are proposed. The copy may run into the
tokens it is producing (as in LZ77), so a repeating pattern is continued past the end of
the sequence. Matching is one vectorised comparison per ``n`` over a window of the
sequence's most recent ``window`` tokens.

Works best where the answer copies from the prompt (rewrite this code, extract, quote)
and in repetitive output; costs nothing when it finds no match (no drafts, plain decoding).
With ``adaptive`` (the default), the draft is as long as the match (how far back the suffix agrees with
the earlier text, at most ``num_tokens``): inside a long copied span drafts are long and
mostly accepted, after a chance 2-gram match short, so the verify forward (whose cost grows
with its tokens on a CPU) is not spent on drafts that are likely rejected.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from lmplug.api import Capabilities, Drafter, DrafterOptions, DraftProposal


class NgramOptions(DrafterOptions):
    min_n: int = Field(default=2, ge=1, description="shortest suffix to match")
    max_n: int = Field(default=4, ge=1, description="longest suffix to match (tried first)")
    window: int = Field(default=4096, ge=8, description="search only the last `window` tokens")
    adaptive: bool = Field(default=True, description="propose only as many tokens as the match is long "
                                                      "(how far back it agrees), at most num_tokens: a long "
                                                      "copy gets long drafts, a chance 2-gram short ones "
                                                      "(false: always num_tokens where a match continues)")

    @model_validator(mode="after")
    def _ordered(self) -> NgramOptions:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        return self


class NgramDrafter(Drafter):
    name = "ngram"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options = NgramOptions

    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        opts = self.options
        return DraftProposal([
            propose_ngram(s.token_ids[-opts.window:], num_tokens, opts.min_n, opts.max_n, opts.adaptive)
            for s in seqs])


def find_match(tokens: torch.Tensor, n: int) -> int | None:
    """Start of the most recent earlier occurrence of the last ``n`` tokens, or None.

    tokens [L] int64. The suffix itself (start ``L - n``) does not count.
    """
    length = tokens.shape[0]
    if length <= n:
        return None
    windows = tokens[:length - 1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram
    hits = (windows == tokens[length - n:]).all(dim=1).nonzero()
    return int(hits[-1]) if hits.numel() else None


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int, adaptive: bool = False) -> list[int]:
    """Up to ``k`` tokens that followed the longest (then most recent) earlier match; with
    ``adaptive``, at most as many as the match is long (``match_length``)."""
    if len(token_ids) < 2:
        return []
    tokens = torch.tensor(token_ids, dtype=torch.int64)
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        start = find_match(tokens, n)
        if start is None:
            continue
        if adaptive:
            k = min(k, match_length(token_ids, start, n, k))
        out = list(token_ids)
        src = start + n
        for _ in range(k):  # overlapping copy: a period shorter than k repeats
            out.append(out[src])
            src += 1
        return out[len(token_ids):]
    return []


def match_length(token_ids: list[int], start: int, n: int, cap: int) -> int:
    """How many tokens (at least ``n``, at most ``cap``) the suffix agrees with what precedes
    ``start + n``: the ``n`` matched ones plus the run of equal tokens before them."""
    end = len(token_ids)
    length = n
    while length < cap and start + n - length - 1 >= 0 and \
            token_ids[start + n - length - 1] == token_ids[end - length - 1]:
        length += 1
    return length
