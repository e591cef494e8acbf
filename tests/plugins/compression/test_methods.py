"""What each method keeps, with a scorer whose surprise is known: characters are tokens, and an
upper-case character costs 5 nats where a lower-case one costs 0.1, so the text a scoring method
must keep is the upper-case text."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from lmplug_compression.llmlingua import LLMLingua, _fine_rates
from lmplug_compression.selective import Selective
from lmplug_compression.truncate import Truncate

from lmplug.interfaces.compressor import CompressionInput, Scorer, Segment


class CaseScorer(Scorer):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def pieces(self, text: str) -> tuple[list[int], list[str]]:
        return [ord(c) for c in text], list(text)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))

    def token_logprobs(self, ids: Sequence[int]) -> list[float]:
        self.calls.append(len(ids))
        return [-5.0 if chr(i).isupper() else -0.1 for i in ids]


def chars(text: str) -> int:
    return len(text)


def _run(method, segments, rate, scorer=None, question=None):
    return method.compress(CompressionInput(tuple(segments), rate, chars, question), scorer)


def test_truncate_keeps_head_and_tail():
    text = " ".join(f"w{i:02d}" for i in range(40))
    result = _run(Truncate(), [Segment(text)], 0.5)
    out = result.segments[0].text
    assert out.startswith("w00 w01 w02") and out.endswith("w37 w38 w39")
    assert "w20" not in out
    assert abs(result.rate - 0.5) <= 0.025


def test_selective_keeps_the_surprising_phrase():
    text = "the cat sat, the dog ran, QUICK BROWN FOX, a cow ate, the end came."
    result = _run(Selective(), [Segment(text), Segment(" Q?", True)], 0.3, CaseScorer())
    assert "QUICK BROWN FOX," in result.segments[0].text
    assert result.segments[1].text == " Q?"


def test_llmlingua_drops_predictable_tokens_first():
    text = "aaaa BBBB cccc DDDD eeee"
    result = _run(LLMLingua(LLMLingua.Options(chunk_tokens=8)), [Segment(text)], 0.5, CaseScorer())
    assert result.segments[0].text.replace(" ", "") .count("B") == 4
    assert result.segments[0].text.replace(" ", "").count("D") == 4


def test_llmlingua_budget_controller_drops_dull_paragraphs_whole():
    paragraphs = ["aaaa aaaa aaaa.\n\n", "XXXX YYYY ZZZZ.\n\n", "bbbb bbbb bbbb.\n\n", "cccc cccc cccc.\n\n"]
    scorer = CaseScorer()
    result = _run(LLMLingua(LLMLingua.Options(coarse_factor=1.0)), [Segment("".join(paragraphs))], 0.25, scorer)
    out = result.segments[0].text
    assert "a" not in out and "b" not in out and "c" not in out
    assert "XXXX YYYY ZZZZ" in out
    assert len(scorer.calls) >= 2  # the paragraphs were scored, then the chunk


def test_llmlingua_conditions_each_chunk_on_the_compressed_prefix():
    scorer = CaseScorer()
    method = LLMLingua(LLMLingua.Options(chunk_tokens=8, context_tokens=4))
    _run(method, [Segment("HEAD ", True), Segment("abcdefgh" * 3)], 0.5, scorer)
    # the protected head conditions the first chunk; later chunks get 4 compressed tokens before them
    assert scorer.calls == [4 + 8, 4 + 8, 4 + 8]


class CopyScorer(CaseScorer):
    """A character seen earlier in the sequence costs 0.1 nats, a new one 5: text makes a
    question likely when it holds the question's characters."""

    def token_logprobs(self, ids: Sequence[int]) -> list[float]:
        self.calls.append(len(ids))
        return [-0.1 if i in ids[:k] else -5.0 for k, i in enumerate(ids)]


QA_PARAGRAPHS = ["kqkq wvwv xjxj.\n\n", "mnmn bcbc fgfg.\n\n", "zed zed zed.\n\n", "hihi tutu ryry.\n\n"]


def test_llmlingua_ranks_paragraphs_by_the_question():
    """Question-aware (LongLLMLingua): the paragraph that makes the question likely is the one
    kept; ranked by perplexity (it has the fewest distinct characters: the lowest), it goes."""
    segments = [Segment("".join(QA_PARAGRAPHS)), Segment("zed?", True)]
    aware = _run(LLMLingua(LLMLingua.Options(coarse_factor=1.0)), segments, 0.2, CopyScorer(), "zed?")
    assert "zed" in aware.segments[0].text and set(aware.segments[0].text) <= set(QA_PARAGRAPHS[2])
    blind = LLMLingua(LLMLingua.Options(coarse_factor=1.0, question_aware=False))
    text = _run(blind, segments, 0.2, CopyScorer(), "zed?").segments[0].text
    assert "z" not in text and "kq" in text


def test_llmlingua_compresses_the_relevant_paragraph_least():
    """Dynamic compression ratio: all paragraphs survive the coarse stage (rate 0.5, factor 2), the
    most relevant one whole, the others lose tokens."""
    segments = [Segment("".join(QA_PARAGRAPHS)), Segment("zed?", True)]
    out = _run(LLMLingua(LLMLingua.Options(coarse_factor=2.0)), segments, 0.5, CopyScorer(), "zed?")
    text = out.segments[0].text
    assert QA_PARAGRAPHS[2] in text
    assert abs(out.rate - 0.5) <= 0.025


def test_fine_rates_meet_the_budget_falling_with_rank():
    sizes, ranked = [10, 20, 10, 40], [2, 0, 3, 1]
    rates = _fine_rates(sizes, 40, ranked)
    assert rates[1] == 1.0
    assert sum(r * n for r, n in zip(rates, sizes)) == pytest.approx(40, abs=1e-6)
    by_rank = [rates[ranked.index(r)] for r in range(4)]
    assert by_rank == sorted(by_rank, reverse=True) and by_rank[-1] < by_rank[0]
    assert _fine_rates(sizes, 40, None) == [0.5] * 4
    assert _fine_rates(sizes, 100, ranked) == [1.0] * 4
