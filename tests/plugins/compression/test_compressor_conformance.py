"""The conformance suite for the first-party compressors; the scoring methods score with a tiny
random Llama run by the core's scorer (``EngineScorer``), with a context short enough that the
test prompt is scored in overlapping windows."""

from __future__ import annotations

from typing import ClassVar

import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401

from lmplug.compression import EngineScorer
from lmplug.config import EngineConfig
from lmplug.loading.tokenizer import Tokenizer
from lmplug.testing import CompressorConformance

SCORER_LEN = 160


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.getbasetemp() / "hf_models_compressor", tokenizer=True)


class ScoredConformance(CompressorConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def scorer(cls, tiny):
        config = EngineConfig.from_dict({"model": str(tiny.path), "device": "cpu", "dtype": "float32",
                                         "max_model_len": SCORER_LEN})
        return EngineScorer(config, SCORER_LEN)

    @pytest.fixture(scope="class")
    @classmethod
    def count_tokens(cls, tiny):
        tok = Tokenizer.from_hf_dir(tiny.path)
        return lambda text: len(tok.encode(text, add_special_tokens=False))


class TestTruncate(CompressorConformance):
    backend = "truncate"


class TestTruncateHeadHeavy(CompressorConformance):
    backend = "truncate"
    options: ClassVar[dict] = {"head": 0.8}


class TestSelective(ScoredConformance):
    backend = "selective"


class TestSelectiveSentences(ScoredConformance):
    backend = "selective"
    options: ClassVar[dict] = {"unit": "sentence", "reduce": "mean"}


class TestLLMLingua(ScoredConformance):
    backend = "llmlingua"
    options: ClassVar[dict] = {"chunk_tokens": 96, "context_tokens": 48}
