"""Prompt compression through ``LLM.generate``: the report on the output, the config default,
the fallback when a method fails, bad input, and the core's scorer against HF's logprobs."""

from __future__ import annotations

import logging
import threading
from typing import ClassVar

import pytest
import torch
from support.hf_models import get_model, hf_logprobs, one_torch_thread  # noqa: F401

from lmplug import ConfigError, SamplingParams
from lmplug.compression import EngineScorer, split_text
from lmplug.config import EngineConfig
from lmplug.hookspecs import hookimpl
from lmplug.interfaces.compressor import Compressor
from lmplug.plugins import Registry
from lmplug.testing.compressor import document

QUESTION = "Question: what is the code? Answer:"
PROMPT = document(3, sentences=1, seed=5) + "\n\n" + QUESTION
GREEDY = SamplingParams(temperature=0, max_tokens=3)
SCORED = {"method": "selective", "scorer_max_len": 128}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.getbasetemp() / "hf_models_compression", tokenizer=True)


@pytest.fixture(scope="module")
def llm(tiny):
    return tiny.llm(compression=SCORED)


def test_generate_reports_tokens_before_and_after(llm):
    for method in ("truncate", "selective", "llmlingua"):
        out = llm.generate(PROMPT, GREEDY, compression={"method": method, "rate": 0.5})[0]
        report = out.compression
        assert report.method == method and report.fallback is None and report.seconds >= 0
        assert report.prompt_tokens_before == len(llm.tokenizer.encode(PROMPT))
        assert report.prompt_tokens_after == len(out.prompt_token_ids) < report.prompt_tokens_before
        assert out.prompt.endswith("\n\n" + QUESTION) and len(out.token_ids) == 3


def test_config_default_applies_unless_turned_off(llm):
    out = llm.generate(PROMPT, GREEDY)[0]
    assert out.compression.method == "selective" and out.compression.rate == 0.5
    plain = llm.generate(PROMPT, GREEDY, compression=False)[0]
    assert plain.compression is None and plain.prompt == PROMPT
    # token ids cannot be compressed: with the config's default they pass through unreported
    ids = llm.tokenizer.encode(PROMPT)
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].compression is None


def test_protect_keeps_spans_and_must_occur(llm):
    span = PROMPT.split("\n\n")[1]
    out = llm.generate(PROMPT, GREEDY, compression={"method": "truncate", "rate": 0.3, "protect": [span]})[0]
    assert span in out.prompt
    with pytest.raises(ConfigError, match="compression.protect"):
        llm.generate(PROMPT, GREEDY, compression={"method": "truncate", "protect": ["not in it"]})


@pytest.mark.parametrize("bad, field", [
    ({"method": "truncate", "rate": 1.5}, "compression.rate"),
    ({"method": "truncate", "rate": 0}, "compression.rate"),
    ({"method": "nope"}, "compression.method"),
    ({"method": "truncate", "options": {"head": 2}}, "compression.options.head"),
    ({"method": "truncate", "options": {"scorer": "x"}}, "compression.options.scorer"),
    ({"method": "truncate", "what": 1}, "compression.what"),
])
def test_bad_compression_names_the_field(llm, bad, field):
    with pytest.raises(ConfigError, match=field):
        llm.generate(PROMPT, GREEDY, compression=bad)


def test_token_ids_with_explicit_compression_refused(llm):
    with pytest.raises(ConfigError, match="compression: needs a text prompt"):
        llm.generate([5, 6, 7], GREEDY, compression={"method": "truncate"})


def test_config_errors_at_load(tiny):
    with pytest.raises(ConfigError, match="compression.rate"):
        tiny.llm(compression={"method": "truncate", "rate": 2})
    with pytest.raises(ConfigError, match="compression.scorer"):
        tiny.llm(compression={"method": "selective", "scorer": "/no/such/model.gguf"})


class Broken(Compressor):
    name = "broken"

    def compress(self, request, scorer):
        raise RuntimeError("the method broke")


class Mangler(Compressor):
    name = "mangler"

    def compress(self, request, scorer):
        from lmplug.interfaces.compressor import CompressionResult, Segment
        return CompressionResult(tuple(Segment("x", s.protected) for s in request.segments), 1, 1)


class FakePlugin:
    LMPLUG_API_VERSION = 3

    @hookimpl
    def lmplug_register_compression_methods(self):
        return [Broken, Mangler, Recorder]


class Recorder(Compressor):
    """Keeps everything; remembers the question each request came with."""

    name = "recorder"
    questions: ClassVar[list] = []

    def compress(self, request, scorer):
        from lmplug.interfaces.compressor import CompressionResult
        Recorder.questions.append(request.question)
        n = sum(request.count_tokens(s.text) for s in request.segments if not s.protected)
        return CompressionResult(request.segments, n, n)


def test_methods_get_the_final_question(llm, monkeypatch):
    registry = Registry()
    assert registry.register(FakePlugin(), name="fake")
    monkeypatch.setattr(llm.compressor, "registry", registry)
    Recorder.questions.clear()
    llm.compressor.compress_text(PROMPT + "\n", {"method": "recorder"})
    chat = [{"role": "system", "content": "Be brief.\n\nVery."},
            {"role": "user", "content": "ctx one\n\n  Which one? "},
            {"role": "assistant", "content": "One.\n\nSure?"}]
    # the tiny model has no chat template: count the rendered chat's tokens without one
    monkeypatch.setattr(llm.compressor.engine.tokenizer, "chat_ids", lambda messages, **_: [0] * len(messages))
    llm.compressor.compress_messages(chat, {"method": "recorder"})
    assert Recorder.questions == [QUESTION, "Which one?"]


def test_failing_compressor_falls_back_to_the_full_prompt(llm, caplog, monkeypatch):
    registry = Registry()
    assert registry.register(FakePlugin(), name="fake")
    monkeypatch.setattr(llm.compressor, "registry", registry)
    full = llm.generate(PROMPT, GREEDY, compression=False)[0]
    for method, why in (("broken", "the method broke"), ("mangler", "changed a protected segment")):
        with caplog.at_level(logging.WARNING, logger="lmplug.compression"):
            out = llm.generate(PROMPT, GREEDY, compression={"method": method})[0]
        assert why in out.compression.fallback and why in caplog.text
        assert out.prompt == PROMPT and out.token_ids == full.token_ids
        assert out.compression.prompt_tokens_after == out.compression.prompt_tokens_before


def test_compression_is_thread_safe_and_deterministic(llm):
    want = llm.compressor.compress_text(PROMPT, {"method": "llmlingua", "rate": 0.4})[0]
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(
        llm.compressor.compress_text(PROMPT, {"method": "llmlingua", "rate": 0.4})[0])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 3


def test_split_text_protects_the_last_paragraph_and_spans():
    segments = split_text("aa bb\n\ncc dd\n\nwhat? ", ["bb"])
    assert [(s.text, s.protected) for s in segments] == [
        ("aa ", False), ("bb", True), ("\n\ncc dd", False), ("\n\nwhat? ", True)]
    assert [(s.text, s.protected) for s in split_text("one paragraph", [])] == [("one paragraph", True)]


def test_scorer_logprobs_match_transformers(tiny):
    config = EngineConfig.from_dict({"model": str(tiny.path), "device": "cpu", "dtype": "float32",
                                     "max_model_len": 64})
    scorer = EngineScorer(config, 64)
    ids, pieces = scorer.pieces("the cat sat on the mat, then left")
    assert "".join(pieces) == "the cat sat on the mat, then left"
    ref = hf_logprobs(tiny.hf, [1, *ids])  # the tiny tokenizer adds BOS (id 1)
    want = ref[:-1].gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(scorer.token_logprobs(ids)), want, atol=1e-4, rtol=1e-4)
    # longer than the context: windows of 62 tokens; past the first, tokens go 31 at a time, each
    # after the 31 before them
    long = (ids * 5)[:150]
    got = scorer.token_logprobs_batch([long, ids])
    assert len(got[0]) == 150 and got[1] == pytest.approx(scorer.token_logprobs(ids), abs=1e-5)
    ref_long = hf_logprobs(tiny.hf, [1, *long[:62]])[:-1].gather(1, torch.tensor(long[:62]).unsqueeze(1))
    torch.testing.assert_close(torch.tensor(got[0][:62]), ref_long.squeeze(1), atol=1e-4, rtol=1e-4)
    ref_tail = hf_logprobs(tiny.hf, [1, *long[62:124]])[31:62]
    torch.testing.assert_close(torch.tensor(got[0][93:124]),
                               ref_tail.gather(1, torch.tensor(long[93:124]).unsqueeze(1)).squeeze(1),
                               atol=1e-4, rtol=1e-4)
