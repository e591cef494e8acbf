"""Sliding-window models keep bounded KV memory with the paged cache, and outputs don't change."""

import pytest
from lmplug_kvcache.block_manager import BlockManager
from support.hf_models import get_model, hf_greedy, one_torch_thread  # noqa: F401  (fixture)

from lmplug import SamplingParams

WINDOW = 16  # the tiny mistral's sliding_window


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return get_model("mistral", tmp_path_factory.mktemp("swa"))


def test_block_manager_releases_blocks_behind_the_window():
    bm = BlockManager(64, 4, sliding_window=8)
    tokens = list(range(100))
    bm.allocate(0, tokens, 20, 0)  # prefill of 20: nothing can be dropped yet
    assert bm.num_used_blocks == 5
    for n in range(20, 100):  # decode: the step writes position n
        bm.allocate(0, tokens, n + 1, n)
        # a query at n sees n - 7 .. n: at most 3 blocks of 4, plus the one being filled
        assert bm.num_used_blocks <= 8 // 4 + 2
    table = bm.block_table(0)
    assert len(table) == 25  # positions still map to table[p // 4]
    bm.free(0, tokens, 100)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 64


def test_fork_of_a_windowed_sequence_shares_only_held_blocks():
    bm = BlockManager(64, 4, sliding_window=8)
    tokens = list(range(40))
    bm.allocate(0, tokens, 30, 0)
    bm.allocate(0, tokens, 31, 30)
    held = bm.num_used_blocks
    bm.fork(0, 1)
    assert bm.num_used_blocks == held
    bm.free(0, tokens, 31)
    bm.free(1, tokens, 31)
    assert bm.num_free_blocks == 64


def test_memory_stays_flat_and_tokens_match(mistral):
    prompt = list(range(3, 27))  # 24 tokens: longer than the window
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    llm = mistral.llm(kvcache={"backend": "paged", "block_size": 4, "num_blocks": 64}, attention="paged",
                      scheduler="continuous")
    engine = llm.engine
    engine.add_request("r", prompt, params)
    usage, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        usage.append(engine.kv.usage)
    # past the window the sequence holds window / block_size + 2 blocks at most
    assert max(usage[10:]) <= (WINDOW // 4 + 2) / 64
    assert out.token_ids == hf_greedy(mistral.hf, prompt, 80)


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_contiguous_ring_buffer_is_bounded_and_exact(mistral, attention):
    # window 16, at most 8 new tokens a step: each row is a ring of 16 + 8 - 1 slots
    prompt = list(range(3, 27))
    llm = mistral.llm(kvcache="contiguous", attention=attention,
                      scheduler={"backend": "continuous", "max_num_batched_tokens": 8})
    kv = llm.engine.kv
    assert kv.row_slots == WINDOW + 8 - 1
    assert kv.layer_view(0).k_cache.shape[1] == WINDOW + 8 - 1
    n = 40 if attention == "flash" else 80  # the interpreted kernels are slow
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(mistral.hf, prompt, n)
