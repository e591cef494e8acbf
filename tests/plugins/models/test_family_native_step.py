"""The native decode step (``lmplug.kit.native_step``) on the Gemma 2/3, Phi-3, SmolLM3, OLMo 2 and
Granite layers: sandwich and post norms, ``1 + w`` norms, GeGLU, q/k norms per head and over all
heads, RoPE per layer (two thetas, NoPE layers, LongRoPE, partial rotary), windows, scales and
soft-caps per layer, residual multipliers.

Reference: the same engine with ``LMPLUG_NATIVE_STEP=0``, the Python layers, whose parity with
transformers ``test_family_gguf.py`` holds on these files. Q8_0 files (``support.gguf_families``,
gguf-py's writer) through the ``gguf`` method's C kernels and the ``paged`` backend's C decode
kernel: both paths call the same products and attention kernel, so their logprobs agree to float32
rounding and their greedy tokens are equal over 32 steps; every decode step is counted native.
"""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from lmplug.kit import fused_cpu

pytestmark = [pytest.mark.hf,
              pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")]

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "attention": "paged",
          "kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 96},
          "quant": {"method": "gguf", "kernel": "native"}}
NEW_TOKENS = 32


def _variants() -> dict[str, dict]:
    from support.gguf_families import family_configs, vocab_size

    # (llama.cpp's gemma2 files always soft-cap: its defaults, 50 and 30, where a header has none;
    # Gemma 3's layers are the sandwich layers without)
    configs = family_configs(vocab_size())
    return {name: configs[name] for name in ("gemma2", "gemma3", "gemma3-scaled-rope", "smollm3", "olmo2", "granite",
                                             "phi3", "phi3-longrope", "phi4mini-partial")}


@pytest.fixture
def counted(monkeypatch):
    """How many steps ran natively, and how many the attention backend declined."""
    from lmplug.kit.native_step import NativeDecodeStep

    seen = {"native": 0, "declined": 0}
    run = NativeDecodeStep.run

    def counting(self, *args):
        out = run(self, *args)
        seen["native" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", counting)
    return seen


def _generate(path, monkeypatch, native: bool, prompts: list[list[int]]):
    from lmplug import LLM, SamplingParams
    from lmplug.kit.native_step import NativeDecodeStep

    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1" if native else "0")
    llm = LLM(str(path), **ENGINE)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5))
    step = llm.engine.parts.model._native_step
    assert isinstance(step, NativeDecodeStep) if native else step is False, step
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("name", list(_variants()))
def test_native_step_gives_the_python_layers_result(tmp_path, monkeypatch, counted, name):
    """Two sequences decoding together, 32 greedy steps each, past the sliding windows (8)."""
    from support.gguf_families import write_family_gguf

    from lmplug.testing.architecture import build_tiny, prompt

    hf = build_tiny(_variants()[name], tmp_path / "hf")
    path = write_family_gguf(hf, tmp_path / "model.gguf", Q.Q8_0)
    prompts = [prompt(20, 1, hf.config.vocab_size), prompt(9, 2, hf.config.vocab_size)]
    native = _generate(path, monkeypatch, True, prompts)
    assert counted["native"] >= NEW_TOKENS - 1 and counted["declined"] == 0, counted
    python = _generate(path, monkeypatch, False, prompts)
    for a, b in zip(native, python):
        assert a.token_ids == b.token_ids, name
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4, (name, tok, la[tok], lb[tok])


@pytest.mark.parametrize("name", ["gemma2", "olmo2", "phi4mini-partial"])
def test_float32_checkpoint_on_one_thread_runs_natively(tmp_path, monkeypatch, counted, torch_threads, name):
    """A float32 HF folder (the core's plain weights) on one compute thread: the kit's own C product
    (``native_dense``); it sums in another order than torch's BLAS, so logprobs agree to float32
    rounding (1e-3 after 32 steps of a random model) and greedy tokens are equal."""
    from lmplug import LLM, SamplingParams
    from lmplug.kit.native_step import NativeDecodeStep
    from lmplug.testing.architecture import build_tiny, prompt

    torch_threads(1)
    hf = build_tiny(_variants()[name], tmp_path / "hf")
    prompts = [prompt(20, 1, hf.config.vocab_size), prompt(9, 2, hf.config.vocab_size)]
    engine = {k: v for k, v in ENGINE.items() if k != "quant"}
    outs = {}
    for native in (True, False):
        monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1" if native else "0")
        llm = LLM(str(tmp_path / "hf"), **engine)
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5))
        step = llm.engine.parts.model._native_step
        assert isinstance(step, NativeDecodeStep) if native else step is False, step
        outs[native] = [o.outputs[0] for o in got]
    assert counted["native"] >= NEW_TOKENS - 1 and counted["declined"] == 0, counted
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids, name
        for la, lb in zip(a.logprobs, b.logprobs):
            for tok in la.keys() & lb.keys():
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-3, (name, tok, la[tok], lb[tok])


def test_more_threads_keep_the_python_layers(tmp_path, monkeypatch, torch_threads):
    """The core's C product is single-threaded: with two compute threads torch's BLAS stays."""
    from lmplug import LLM, SamplingParams
    from lmplug.testing.architecture import build_tiny

    build_tiny(_variants()["olmo2"], tmp_path / "hf")
    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1")
    torch_threads(2)
    llm = LLM(str(tmp_path / "hf"), **{k: v for k, v in ENGINE.items() if k != "quant"})
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.parts.model._native_step is False
