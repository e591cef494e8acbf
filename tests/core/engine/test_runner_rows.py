"""The runner's host path of a step: the rows it samples from read in place (a slice of the
hidden states where they are consecutive) and one inference-mode region around the forward."""

from __future__ import annotations

import itertools

import pytest
import torch

from lmplug.engine import runner as runner_module
from lmplug.engine.runner import _as_slice


@pytest.mark.parametrize("rows", [[0], [3], [2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7], [0, 2], [1, 2, 4], [5, 9, 10]])
def test_consecutive_rows_read_as_a_view_of_the_same_rows(rows):
    hidden = torch.randn(12, 5)
    got = hidden[_as_slice(rows)]
    assert torch.equal(got, hidden[torch.tensor(rows)])
    consecutive = rows == list(range(rows[0], rows[-1] + 1))
    assert (got.data_ptr() == hidden[rows[0]].data_ptr() and got.is_contiguous()) is consecutive


def _generate(llm, prompts):
    from lmplug import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in row.items()} for row in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


def test_decode_steps_sample_the_hidden_rows_in_place_with_the_same_tokens(demo_gguf, monkeypatch):
    """The demo model (the native decode step): every step's logits come from a view of the
    forward's hidden states, inside inference mode, and give the tokens and logprobs the index
    copy gave (the runner's rows as a list, as before)."""
    from lmplug import LLM

    llm = LLM(str(demo_gguf), max_model_len=128)
    model = llm.engine.runner.model
    forward, logits_of, seen = model.forward, model.compute_logits, []

    def recording_forward(*args):
        out = forward(*args)
        seen.append(("forward", out.data_ptr(), out.shape[0]))
        return out

    def recording_logits(hidden):
        seen.append(("logits", hidden.data_ptr(), torch.is_inference_mode_enabled()))
        return logits_of(hidden)

    monkeypatch.setattr(model, "forward", recording_forward)
    monkeypatch.setattr(model, "compute_logits", recording_logits)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1203, 282, 260]]
    got = _generate(llm, prompts)
    steps = [(a, b) for a, b in itertools.pairwise(seen) if a[0] == "forward" and b[0] == "logits"]
    decodes = [(f, g) for f, g in steps if f[2] == len(prompts)]  # both sequences decoding
    assert decodes and all(g[2] for _, g in steps)  # the head runs in inference mode
    assert all(g[1] == f[1] for f, g in decodes)  # rows 0..1 of the hidden states, not a copy

    monkeypatch.setattr(runner_module, "_as_slice", lambda rows: rows)  # the index copy
    assert _generate(llm, prompts) == got


def test_decode_steps_keep_the_kernels_they_loaded(demo_gguf, monkeypatch):
    """The demo model's embedding (GGUF) and native step attention (sdpa) load their C libraries
    once: ``load()`` reads three environment variables, which a decode step no longer pays. A
    fresh ``load()`` still follows the environment (``tests/plugins/attention/test_paged_native.py``)."""
    from lmplug_attention.paged import native as paged_native
    from lmplug_quant import gguf_native

    from lmplug import LLM

    llm = LLM(str(demo_gguf), max_model_len=128)
    prompts = [[1, 504, 3458, 282, 4649, 314]]
    want = _generate(llm, prompts)

    def no_load():
        raise AssertionError("load() called during a decode step")

    monkeypatch.setattr(paged_native, "load", no_load)
    monkeypatch.setattr(gguf_native, "load", no_load)
    assert _generate(llm, prompts) == want
