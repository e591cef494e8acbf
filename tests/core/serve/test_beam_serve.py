"""Beam search through the server on the demo model, with the official ``openai`` client:
``use_beam_search`` (with ``best_of`` as the width), ``length_penalty``, ``early_stopping`` and a
``guided_regex`` constraint give what ``LLM.generate`` gives with the same ``SamplingParams``; what
beams refuse is a 400 naming the request field."""

from __future__ import annotations

import re

import pytest

from lmplug import SamplingParams

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
REGEX = r" [A-Z][a-z]{2,8}\."


def beams(client, **body):
    extra = {k: body.pop(k) for k in ("use_beam_search", "length_penalty", "early_stopping", "guided_regex",
                                      "ignore_eos", "repetition_penalty") if k in body}
    out = client.completions.create(model="demo", prompt=PROMPT, extra_body=extra, **body)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_beams_equal_llm(client, ref):
    got = beams(client, n=2, best_of=3, max_tokens=8, use_beam_search=True, length_penalty=0.5,
                early_stopping=True, ignore_eos=True)
    want = ref.generate(PROMPT, SamplingParams(n=2, beam_width=3, max_tokens=8, length_penalty=0.5,
                                               early_stopping=True, ignore_eos=True))[0]
    assert got == [c.text for c in want.outputs]
    assert len(set(got)) == 2


def test_constrained_beams_equal_llm(client, ref):
    got = beams(client, n=3, max_tokens=12, use_beam_search=True, guided_regex=REGEX)
    want = ref.generate(PROMPT, SamplingParams(n=3, beam_width=3, max_tokens=12, structured={"regex": REGEX}))[0]
    assert got == [c.text for c in want.outputs]
    assert all(re.fullmatch(REGEX, text) for text in got), got


@pytest.mark.parametrize("body,field", [
    ({"n": 2, "best_of": 9}, "best_of"),  # above the scheduler's max_num_seqs (8)
    ({"n": 9}, "n"),
    ({"n": 2, "presence_penalty": 0.5}, "presence_penalty"),
    ({"n": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"n": 2, "logprobs": 2}, "logprobs"),
    ({"n": 3, "best_of": 2}, "best_of"),
])
def test_refused_beams_are_a_400_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as info:
        beams(client, max_tokens=4, use_beam_search=True, **body)
    assert info.value.status_code == 400 and info.value.body["param"] == field


def test_streamed_beams_come_whole_at_the_end(client):
    """Beams are not results until the group ends: a stream gets each result in one piece."""
    body = {"n": 2, "max_tokens": 6, "extra_body": {"use_beam_search": True, "ignore_eos": True}}
    texts = {0: [], 1: []}
    for chunk in client.completions.create(model="demo", prompt=PROMPT, stream=True, **body):
        for c in chunk.choices:
            if c.text:
                texts[c.index].append(c.text)
    assert [len(t) for t in texts.values()] == [1, 1]
    assert ["".join(t) for t in texts.values()] == beams(client, n=2, max_tokens=6, use_beam_search=True,
                                                         ignore_eos=True)
