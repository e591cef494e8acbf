"""``n > 1`` forks have one owner (``lmplug.engine.forks.Forks``): with a cache and scheduler that
fork, a request's siblings wait until its first sequence's first token and then share its prompt's
blocks; without, every sample is scheduled as its own sequence from the start."""

from __future__ import annotations

import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)

from lmplug import SamplingParams

PARAMS = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 23))  # 20 tokens: 5 blocks of 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("forks"))


def test_siblings_fork_from_the_first_sequence_at_its_first_token(model):
    engine = model.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 64},
                       scheduler={"backend": "continuous", "max_num_seqs": 8}).engine
    assert engine.forks.enabled
    engine.add_request("r", PROMPT, PARAMS)
    assert (engine.scheduler.num_running + engine.scheduler.num_waiting) == 1
    engine.step()  # the prompt, then the first token of all three
    assert engine.scheduler.num_running == 3
    assert round(engine.kv.usage * 64) < 3 * 5  # the prompt's 5 full blocks are shared, not one set per sample
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [len(c.token_ids) for c in outs[-1].outputs] == [4, 4, 4]


def test_without_fork_every_sample_is_scheduled_at_once(model):
    engine = model.llm(kvcache="contiguous", scheduler={"backend": "continuous", "max_num_seqs": 8}).engine
    assert not engine.forks.enabled
    engine.add_request("r", PROMPT, PARAMS)
    assert engine.scheduler.num_running + engine.scheduler.num_waiting == 3
