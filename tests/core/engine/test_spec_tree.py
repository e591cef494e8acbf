"""Tree speculative decoding (Medusa tree candidates verified with tree attention).

- greedy tree verification on hand-built logits;
- tree attention: the target's logits at every node of a random tree equal transformers'
  logits for the root-to-node path run as an ordinary sequence (sdpa and paged attention,
  contiguous and paged KV, a sliding-window Mistral whose window the context exceeds);
- the KV move: after a non-first path is accepted, the cache holds what a plain forward of
  those tokens writes;
- the engine with medusa trees: greedy output equals plain greedy decoding for both
  schedulers and KV layouts, under preemption, with sampling requests mixed in (seeded ones
  reproducible whatever shares the batch);
- load-time refusals: tree with attention that has no tree mask, bad tree specs.
"""

from __future__ import annotations

import pytest
import torch
from lmplug_speculative.medusa import MC_SIM_7B_63, TREE_PRESETS, tree_for_heads
from lmplug_speculative.medusa_heads import MedusaHeads, save_heads
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401 - fixture
from support.spec_helpers import check_observed_hidden, make_engine, run

from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.sequence import Sequence
from lmplug.kit.draft_tree import ancestor_mask, depths, is_chain
from lmplug.speculative import Draft, Speculator
from lmplug.speculative.tree import first_child_chain, subtree, verify_tree_greedy

V = 20


def rows_with_argmax(best: list[int]) -> torch.Tensor:
    logits = torch.randn(len(best), V)
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


# -- structures and greedy verification on hand-built logits ------------------------------------
#   root -> 0 (5) -> 2 (7) -> 4 (9)
#        |        \-> 3 (8)
#        \-> 1 (6)
PARENTS = [-1, -1, 0, 0, 2]
TOKENS = [5, 6, 7, 8, 9]


def test_tree_structures():
    assert depths(PARENTS) == [1, 1, 2, 2, 3]
    mask = ancestor_mask(PARENTS)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],   # root
                             [1, 1, 0, 0, 0, 0],   # node 0
                             [1, 0, 1, 0, 0, 0],   # node 1
                             [1, 1, 0, 1, 0, 0],   # node 2
                             [1, 1, 0, 0, 1, 0],   # node 3
                             [1, 1, 0, 1, 0, 1]], dtype=torch.bool)  # node 4
    assert torch.equal(mask, expected)
    assert first_child_chain(PARENTS) == [0, 2, 4]
    assert subtree(PARENTS, [0, 1, 3]) == [-1, -1, 0]
    assert is_chain([-1, 0, 1]) and not is_chain(PARENTS)
    with pytest.raises(ValueError, match="parents must come first"):
        depths([-1, 2, 0])


def test_verify_accepts_the_deepest_matching_path_and_the_leaf_bonus():
    # row 0: root -> 5 (node 0); row 1: node 0 -> 7 (node 2); row 3: node 2 -> 9 (node 4); row 5: bonus 11
    logits = rows_with_argmax([5, 7, 0, 9, 0, 11])
    v = verify_tree_greedy(logits, TOKENS, PARENTS)
    assert v.tokens == [5, 7, 9, 11] and v.nodes == [0, 2, 4] and v.rows == [0, 1, 3, 5]


def test_verify_takes_a_second_child_and_stops_at_a_mismatch():
    logits = rows_with_argmax([5, 8, 0, 0, 3, 0])  # node 0 -> 8 is node 3 (a leaf): bonus from row 4
    v = verify_tree_greedy(logits, TOKENS, PARENTS)
    assert v.tokens == [5, 8, 3] and v.nodes == [0, 3] and v.rows == [0, 1, 4]
    logits = rows_with_argmax([6, 0, 4, 0, 0, 0])  # root -> 6 is node 1, then 4 is no child (leaf anyway)
    assert verify_tree_greedy(logits, TOKENS, PARENTS).tokens == [6, 4]
    logits = rows_with_argmax([5, 13, 0, 0, 0, 0])  # node 0 -> 13: no such child, correction 13
    v = verify_tree_greedy(logits, TOKENS, PARENTS)
    assert v.tokens == [5, 13] and v.nodes == [0]


def test_verify_rejects_at_the_root():
    v = verify_tree_greedy(rows_with_argmax([12, 5, 7, 8, 9, 1]), TOKENS, PARENTS)
    assert v.tokens == [12] and v.nodes == [] and v.rows == [0]


def test_verify_prefers_the_first_sibling_with_the_token():
    parents, tokens = [-1, -1, 1], [4, 4, 2]  # two root children carry 4; only the second has a child
    v = verify_tree_greedy(rows_with_argmax([4, 2, 2, 3]), tokens, parents)
    assert v.nodes == [0] and v.tokens == [4, 2]


def test_verify_checks_the_row_count():
    with pytest.raises(ValueError, match="logits rows"):
        verify_tree_greedy(torch.zeros(3, V), TOKENS, PARENTS)


# -- tree attention against transformers --------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("tree"))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return get_model("mistral", tmp_path_factory.mktemp("tree"))  # sliding window 16


def random_tree(n: int, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(-1, j, (1,), generator=g)) for j in range(1, n)]
    tokens = torch.randint(3, 500, (n,), generator=g).tolist()
    return parents, tokens


def path_to(parents: list[int], tokens: list[int], j: int) -> list[int]:
    path = []
    while j >= 0:
        path.append(tokens[j])
        j = parents[j]
    return path[::-1]


def prefill(engine, seq: Sequence, upto: int, chunk: int = 8) -> None:
    """Compute K/V of positions [num_computed, upto) in chunks (a ring cache holds a step's worth)."""
    while seq.num_computed_tokens < upto:
        n = min(chunk, upto - seq.num_computed_tokens)
        engine.kv.allocate(seq, seq.num_computed_tokens + n)
        engine.runner.execute([ScheduledSeq(seq, n)])
        seq.num_computed_tokens += n


def tree_step(engine, items: list[tuple[Sequence, list[int] | None, list[int]]], spec=None):
    """One step: each (seq, parents or None for a plain decode, drafts) verifies its drafts
    (put into the step by ``spec``, a speculator without a drafter by default)."""
    spec = spec or Speculator(drafter=None, num_tokens=8, kv=engine.kv, max_model_len=256)
    batch = []
    for seq, parents, drafts in items:
        n = 1 + len(drafts)
        engine.kv.allocate(seq, seq.num_computed_tokens + n)
        item = ScheduledSeq(seq, n)
        if drafts:
            spec.add_draft(item, Draft(list(drafts), None, parents))
        batch.append(item)
    result = engine.runner.execute(batch)
    for item in batch:
        item.seq.num_computed_tokens += item.num_new_tokens
    return result


GREEDY1 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
ATTENTION_CASES = {
    "sdpa-contiguous": {},
    "sdpa-paged": {"attention": "sdpa", "kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 64}},
    "paged-paged": {"attention": {"backend": "paged", "kernels": "torch"},
                    "kvcache": {"backend": "paged", "block_size": 4, "num_blocks": 64}},
}


@pytest.mark.parametrize("which", ["llama", "mistral"])
@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_tree_logits_equal_each_path_run_as_a_sequence(llama, mistral, which, case):
    """Two tree sequences and a plain decode in one step; each node's logits = transformers' logits
    after its root-to-node path (Mistral: 30 tokens of context past a window of 16; the contiguous
    cache then is a ring of window + budget - 1 slots)."""
    model = llama if which == "llama" else mistral
    sched = {"scheduler": {"backend": "continuous", "max_num_batched_tokens": 16}}
    engine = make_engine(model.path, **case, **sched)
    assert engine.runner.model is not None
    seqs, trees = [], [random_tree(9, 1), random_tree(6, 2)]
    for s, length in enumerate([30, 21, 25]):
        seq = Sequence(f"s{s}", prompt_ids(length, 70 + s), GREEDY1)
        prefill(engine, seq, length - 1)
        seqs.append(seq)
    result = tree_step(engine, [(seqs[0], trees[0][0], trees[0][1]), (seqs[1], None, []),
                                (seqs[2], trees[1][0], trees[1][1])])
    assert result.num_rows == [1, 7, 10]  # decodes first, then short queries shortest first
    rows = dict(zip([r.seq.seq_id for r in result.sample_rows], torch.split(result.logits, result.num_rows)))
    hf = model.hf
    with torch.no_grad():
        for seq, tree in [(seqs[0], trees[0]), (seqs[2], trees[1])]:
            parents, tokens = tree
            context = seq.token_ids[:seq.num_tokens - len(tokens)]
            for j in range(-1, len(tokens)):
                ids = context + (path_to(parents, tokens, j) if j >= 0 else [])
                expected = hf(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(rows[seq.seq_id][j + 1], expected, atol=2e-4, rtol=2e-4)
        plain = seqs[1].token_ids
        torch.testing.assert_close(rows[seqs[1].seq_id][0], hf(torch.tensor([plain])).logits[0, -1],
                                   atol=2e-4, rtol=2e-4)


# -- the KV move ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["llama", "mistral"])
@pytest.mark.parametrize("kvcache", [{}, {"backend": "paged", "block_size": 4, "num_blocks": 64},
                                     {"backend": "paged", "block_size": 4, "num_blocks": 64, "dtype": "int8"}],
                         ids=["contiguous", "paged", "paged-int8"])
def test_accepted_path_kv_equals_a_plain_forward(llama, mistral, which, kvcache):
    model = llama if which == "llama" else mistral
    engine = make_engine(model.path, **({"kvcache": kvcache} if kvcache else {}),
                         scheduler={"backend": "continuous", "max_num_batched_tokens": 16})
    prompt = prompt_ids(22, 81)
    with torch.no_grad():  # the target's greedy continuation: g0 (the root), g1, g2, g3
        ids = list(prompt)
        for _ in range(4):
            ids.append(int(model.hf(torch.tensor([ids])).logits[0, -1].argmax()))
    g = ids[len(prompt):]
    wrong = [(t + 1) % 500 + 3 for t in g]
    # root -> 0 (wrong) -> 2 (g2); root -> 1 (g1) -> 3 (wrong), 4 (g2) -> 5 (g3)
    parents, tokens = [-1, -1, 0, 1, 1, 4], [wrong[1], g[1], g[2], wrong[2], g[2], g[3]]
    seq = Sequence("t", prompt + [g[0]], GREEDY1)
    prefill(engine, seq, len(prompt))
    spec = Speculator(drafter=None, num_tokens=8, kv=engine.kv, max_model_len=256)
    result = tree_step(engine, [(seq, parents, tokens)], spec)
    emitted, rows = spec.verify(result.logits, result.num_rows, [seq])
    assert emitted == [[g[1], g[2], g[3], emitted[0][-1]]] and rows == [[0, 2, 5, 6]]
    seq.token_ids.extend(emitted[0])
    spec.rollback(seq)
    assert seq.num_computed_tokens == len(prompt) + 4  # the prompt, the root g0 and the accepted g1 g2 g3
    # the reference: a fresh sequence computing the same tokens plainly
    ref = Sequence("r", list(seq.token_ids), GREEDY1)
    prefill(engine, ref, seq.num_computed_tokens)
    bs = engine.kv.block_size
    ta, tb = engine.kv.block_table(seq), engine.kv.block_table(ref)
    for layer in range(engine.kv.spec.num_layers):
        view = engine.kv.layer_view(layer)
        for t in (view.k_cache, view.v_cache, view.k_scale, view.v_scale):
            if t is None:
                continue
            for p in range(len(prompt) + 1, len(prompt) + 4):
                a, b = t[ta[p // bs], p % bs], t[tb[p // bs], p % bs]
                torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=1e-5)
    # and decoding goes on from the moved cache as from the plain one
    spec_next = engine.runner.execute([_one(engine, seq)]).logits[-1]
    ref_next = engine.runner.execute([_one(engine, ref)]).logits[-1]
    torch.testing.assert_close(spec_next, ref_next, atol=1e-4, rtol=1e-4)


def _one(engine, seq: Sequence) -> ScheduledSeq:
    engine.kv.allocate(seq, seq.num_computed_tokens + 1)
    return ScheduledSeq(seq, 1)


# -- medusa trees in the engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("tree_engine"), tokenizer=True)


@pytest.fixture(scope="module")
def random_heads(model, tmp_path_factory):
    torch.manual_seed(5)
    heads = MedusaHeads(64, 512, num_heads=3, num_layers=1)
    for head in heads:
        torch.nn.init.normal_(head[0].linear.weight, std=0.3)
        torch.nn.init.normal_(head[-1].weight, std=0.3)
    return save_heads(heads, tmp_path_factory.mktemp("random_heads"), dtype=torch.float32)


@pytest.fixture(scope="module")
def near_heads(model, tmp_path_factory):
    """Heads that are the target's own lm_head over a slightly perturbed hidden state: their top
    ranks overlap the target's next tokens often (this tiny model repeats itself), not always."""
    torch.manual_seed(6)
    heads = MedusaHeads(64, 512, num_heads=3, num_layers=1)
    with torch.no_grad():
        for head in heads:
            head[0].linear.weight.normal_(std=0.05)
            head[-1].weight.copy_(model.hf.lm_head.weight)
    return save_heads(heads, tmp_path_factory.mktemp("near_heads"), dtype=torch.float32)


PROMPTS = [prompt_ids(5, 91), prompt_ids(19, 92), prompt_ids(33, 93)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PAGED = {"backend": "paged", "block_size": 4, "num_blocks": 200}
ENGINE_CASES = {
    "contiguous-continuous": {},
    "paged-continuous": {"kvcache": PAGED},
    "paged-prefix-continuous": {"kvcache": {**PAGED, "prefix_caching": True}},
    "contiguous-static": {"scheduler": "static"},
    "paged-static": {"kvcache": PAGED, "scheduler": "static"},
    "paged-sdpa": {"kvcache": PAGED, "attention": "sdpa"},
    "paged-preempting": {"kvcache": {**PAGED, "num_blocks": 24}},
    "budget-cuts-trees": {"kvcache": PAGED, "scheduler": {"backend": "continuous", "max_num_batched_tokens": 12}},
}


@pytest.fixture(scope="module")
def reference(model):
    return [o.token_ids for o in run(make_engine(model.path), PROMPTS, GREEDY)]


def medusa(heads, tree="default", **extra) -> dict:
    return {"method": "medusa", "heads": str(heads), "num_tokens": 3, "tree": tree, **extra}


@pytest.mark.parametrize("case", ENGINE_CASES.values(), ids=ENGINE_CASES.keys())
def test_greedy_with_a_medusa_tree_equals_plain_greedy(model, near_heads, reference, case):
    engine = make_engine(model.path, medusa(near_heads), **case)
    outs = run(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    spec = engine.speculator
    assert 0 < spec.num_accepted < spec.num_verified * 3  # some paths accepted, not always the deepest
    assert engine.kv.usage == 0
    if case.get("kvcache", {}).get("num_blocks") == 24:
        assert engine.scheduler.num_preemptions > 0
    # per request: drafted = tree nodes verified, accepted = accepted path lengths
    assert sum(o.metrics.num_drafted_tokens for o in outs) == spec.num_drafted
    assert sum(o.metrics.num_accepted_tokens for o in outs) == spec.num_accepted
    assert spec.num_drafted > 3 * spec.num_verified  # trees, not chains of 3


def test_random_heads_and_an_explicit_tree(model, random_heads, reference):
    tree = [[0], [1], [0, 0], [2], [0, 1], [1, 0], [0, 0, 0], [3, 0]][:-1] + [[2, 0]]
    engine = make_engine(model.path, medusa(random_heads, tree), kvcache=PAGED)
    assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    assert engine.speculator.num_drafted > 0


def test_a_tree_accepts_more_per_forward_than_its_first_chain(model, near_heads, reference):
    chain = make_engine(model.path, medusa(near_heads, [[0], [0, 0], [0, 0, 0]]))
    tree = make_engine(model.path, medusa(near_heads, "mc_sim_7b_63"))
    for engine in (chain, tree):
        assert [o.token_ids for o in run(engine, PROMPTS, GREEDY)] == reference
    assert tree.speculator.num_accepted > chain.speculator.num_accepted


def test_mixed_greedy_and_seeded_sampling(model, near_heads, reference):
    """Greedy rows get trees and still decode the reference; seeded sampling rows get sampled chains
    and decode the same whatever shares the batch."""
    sampled = SamplingParams(temperature=0.9, top_k=20, max_tokens=20, ignore_eos=True, seed=7)
    alone = run(make_engine(model.path, medusa(near_heads), kvcache=PAGED), [PROMPTS[1]], sampled)[0]
    engine = make_engine(model.path, medusa(near_heads), kvcache=PAGED)
    outs = run(engine, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [GREEDY, sampled, GREEDY])
    assert outs[1].token_ids == alone.token_ids
    assert [outs[0].token_ids, outs[2].token_ids] == [reference[0], reference[2]]
    other = SamplingParams(temperature=1.1, max_tokens=20, ignore_eos=True, seed=8)
    again = run(make_engine(model.path, medusa(near_heads)), [PROMPTS[2], PROMPTS[1]], [other, sampled])
    assert again[1].token_ids == alone.token_ids


def test_speculator_cuts_a_tree_to_its_first_children_for_sampling_and_to_max_tokens():
    class Fake:
        name, drafts_trees = "fake", True

    spec = Speculator(Fake(), num_tokens=4, kv=None, max_model_len=256)
    sampled = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=10))
    assert spec._fit_tree(sampled, TOKENS, None, PARENTS) == ([5, 7, 9], None, None)
    greedy = Sequence("b", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))  # room for depth 2
    assert spec._fit_tree(greedy, TOKENS, None, PARENTS) == ([5, 6, 7, 8], None, [-1, -1, 0, 0])
    Fake.drafts_trees = False
    with pytest.raises(RuntimeError, match="drafts_trees"):
        spec._fit_tree(greedy, TOKENS, None, PARENTS)


def test_presets_and_tree_order():
    assert TREE_PRESETS["default"] == MC_SIM_7B_63[:16] and len(MC_SIM_7B_63) == 63
    tree = tree_for_heads("mc_sim_7b_63", 2)
    assert all(len(p) <= 2 for p in tree.paths) and tree.depth == 2
    tree = tree_for_heads([[0, 0], [1], [0]], 3)  # a child listed before its parent: sorted by depth
    assert tree.paths == [(1,), (0,), (0, 0)] and tree.parents == [-1, -1, 1]


# -- load-time refusals --------------------------------------------------------------------------
@pytest.mark.parametrize("tree, match", [
    ([[0], [0, 0], [1, 0]], r"\[1, 0\] lacks its parent"),
    ([[0], []], "empty path"),
    ([[0], [40]], "ranks must be in"),
    ([[0], [0]], "listed twice"),
    ([[i] for i in range(30)] + [[0, i] for i in range(30)] + [[0, 0, i] for i in range(5)], "at most 64"),
    ("wide", "unknown tree preset"),
])
def test_bad_trees_are_refused(model, random_heads, tree, match):
    with pytest.raises(ConfigError, match=match) as err:
        make_engine(model.path, medusa(random_heads, tree))
    assert "speculative" in str(err.value) and "tree" in str(err.value)


def test_a_tree_deeper_than_the_heads_is_refused(model, random_heads):
    with pytest.raises(ConfigError, match=r"speculative.tree: path \[0, 0, 0, 0\] is 4 deep"):
        make_engine(model.path, medusa(random_heads, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]))


@pytest.mark.parametrize("attention", [{"backend": "flash"}, {"backend": "paged", "kernels": "triton"}],
                         ids=["flash", "paged-triton"])
def test_a_tree_without_tree_attention_is_refused(model, random_heads, attention):
    kv = {} if attention["backend"] == "flash" else {"kvcache": PAGED}
    with pytest.raises(ConfigError, match=f"speculative: medusa: tree candidates.*{attention['backend']!r}"):
        make_engine(model.path, medusa(random_heads), attention=attention, **kv)
    make_engine(model.path, medusa(random_heads, None), attention=attention, **kv)  # a chain is fine


def test_logprobs_come_from_the_rows_of_the_accepted_path(model, near_heads):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    plain = run(make_engine(model.path), PROMPTS, params)
    engine = make_engine(model.path, medusa(near_heads, "mc_sim_7b_63"))
    outs = run(engine, PROMPTS, params)
    assert engine.speculator.num_accepted > 0
    for a, b in zip(outs, plain):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4 and la[t].rank == lb[t].rank


def test_observed_hidden_state_is_the_accepted_leafs(model, near_heads):
    """After every step medusa holds the target's hidden state at the last accepted position (the
    node whose logits chose the last token), as a fresh prefill computes it."""
    engine = make_engine(model.path, medusa(near_heads, "mc_sim_7b_63"), kvcache=PAGED)
    assert check_observed_hidden(engine, PROMPTS, GREEDY) > 10 and engine.speculator.num_accepted > 0
