"""The server's beam search fields (vLLM's ``use_beam_search``, ``length_penalty``,
``early_stopping``; ``best_of`` as the beam width, or best-of sampling without beams) become
``SamplingParams``; bad ones are a 400."""

from __future__ import annotations

import pytest

from lmplug.serve.convert import sampling_params
from lmplug.serve.errors import APIError
from lmplug.serve.protocol import CompletionRequest


def params(**body):
    return sampling_params(CompletionRequest(prompt=[5, 6, 7], max_tokens=4, **body), [[5, 6, 7]], 64, None)


def test_use_beam_search_sets_the_beam_fields():
    sp = params(n=2, best_of=4, use_beam_search=True, length_penalty=0.5, early_stopping="never")
    assert (sp.n, sp.beam_width, sp.length_penalty, sp.early_stopping) == (2, 4, 0.5, "never")
    assert params(n=3, use_beam_search=True).beam_width == 3
    assert params(n=2).beam_width == 0


def test_best_of_without_beams_is_best_of_sampling():
    sp = params(n=2, best_of=5)
    assert (sp.n, sp.best_of, sp.beam_width) == (2, 5, 0)
    assert params(n=2, best_of=2).best_of is None  # best_of == n: plain sampling


@pytest.mark.parametrize("body,field", [
    ({"n": 3, "best_of": 2, "use_beam_search": True}, "best_of"),
    ({"n": 1, "best_of": 3, "stream": True}, "best_of"),  # the best are known only at the end
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"n": 1, "use_beam_search": True, "early_stopping": True, "length_penalty": float("nan")}, "length_penalty"),
])
def test_bad_beam_fields_are_a_400_naming_the_field(body, field):
    with pytest.raises(APIError) as info:
        params(**body)
    assert info.value.status == 400 and info.value.param == field
