"""The paged cache's memory accounting per layer group (``layer_groups.py``): models whose layers
mix sliding windows and full attention (Gemma 2 1:1, Gemma 3 5:1) keep one block table per
sequence, so no group releases blocks alone; the cache reports per group what its layers hold
and at most need, and generates what the contiguous cache generates."""

from __future__ import annotations

import pytest


def _reach(window: int, block_size: int, max_pos: int = 400) -> int:
    """The most distinct blocks one query's window (p - window, p] touches, by enumeration."""
    return max(len({k // block_size for k in range(max(0, p - window + 1), p + 1)}) for p in range(max_pos))


@pytest.mark.parametrize("window,block_size", [(4, 2), (5, 4), (8, 8), (1, 16), (33, 16)])
def test_accounting_of_two_groups(window, block_size):
    from lmplug_kvcache.layer_groups import layer_groups

    held = [10, 1, 3]
    groups = layer_groups([window, None, window, None, None], block_size, [100] * 5, held)
    windowed, full = groups
    assert (windowed.window, windowed.layers) == (window, (0, 2))
    assert (full.window, full.layers) == (None, (1, 3, 4))
    assert windowed.held_bytes == sum(held) * 100 * 2 and full.held_bytes == sum(held) * 100 * 3
    assert full.needed_bytes == full.held_bytes and full.releasable_bytes == 0
    # a sequence's window layers need at most the blocks one query's window touches (no more than held)
    reach = _reach(window, block_size)
    assert windowed.needed_bytes == sum(min(n, reach) for n in held) * 100 * 2


TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128}
MODELS = {
    "gemma2": {**TINY, "model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4,
               "attn_logit_softcapping": 5.0, "query_pre_attn_scalar": 8},
    "gemma3": {**TINY, "model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 4,
               "sliding_window_pattern": 6},
}
GROUPS = {"gemma2": [(4, (0, 2)), (None, (1, 3))], "gemma3": [(4, (0, 1, 2, 3, 4)), (None, (5,))]}


@pytest.mark.hf
@pytest.mark.parametrize("model", sorted(MODELS))
def test_windowed_models_on_the_paged_cache(tmp_path, model):
    from lmplug import LLM, SamplingParams
    from lmplug.testing.architecture import build_tiny

    build_tiny(MODELS[model], tmp_path)
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
    common = {"device": "cpu", "dtype": "float32", "max_model_len": 64}
    contiguous = LLM(str(tmp_path), attention={"backend": "sdpa"}, kvcache={"backend": "contiguous"},
                     **common).generate(prompts, greedy)
    paged = LLM(str(tmp_path), attention={"backend": "paged"}, kvcache={"backend": "paged", "block_size": 2}, **common)
    assert [o.token_ids for o in paged.generate(prompts, greedy)] == [o.token_ids for o in contiguous]

    engine = paged.engine
    assert [(g.window, g.layers) for g in engine.kv.layer_groups()] == GROUPS[model]
    engine.add_request("long", list(range(5, 26)), greedy)  # 21 prompt tokens: 11 blocks of 2
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    windowed, full = engine.kv.layer_groups()
    layer_block = engine.kv.bytes_per_token // engine.kv.spec.num_layers * 2
    held = full.held_bytes // (layer_block * len(full.layers))
    assert held >= 11 and full.needed_bytes == full.held_bytes
    assert windowed.held_bytes == held * layer_block * len(windowed.layers)  # one table: every block kept
    # a window of 4 tokens in blocks of 2 touches at most 3 blocks
    assert windowed.needed_bytes == 3 * layer_block * len(windowed.layers)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.usage == 0 and engine.kv.layer_groups()[0].held_bytes == 0
