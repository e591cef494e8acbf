"""EAGLE-2's dynamic tree bookkeeping (``eagle_dynamic.DynamicTree``) on hand-made
distributions: values are path sums of log-probabilities, the frontier is the best
``top_k`` of the newest children, the kept nodes are the best ``total`` and form a tree.
(The drafter's trees against a dense reference EAGLE-2: test_spec_eagle.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from lmplug_speculative.eagle_dynamic import DynamicTree


def logp(*probs):
    return torch.tensor([math.log(p) if p > 0 else float("-inf") for p in probs])


def paths(tokens, parents):
    out = []
    for t, p in zip(tokens, parents):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


def test_growth_and_selection_follow_path_values():
    tree = DynamicTree(logp(0.6, 0.3, 0.1, 0.0), top_k=4)  # token 3 impossible: never a node
    assert tree.tokens == [0, 1, 2] and tree.frontier == [0, 1, 2]
    nodes, parents = tree.head_query()
    assert nodes == [0, 1, 2] and parents == [-1, -1, -1]
    # after token 0: 0.9 / 0.1; after 1: 0.5 / 0.5; after 2: 1.0
    tree.expand(torch.stack([logp(0.9, 0.1, 0, 0), logp(0, 0, 0.5, 0.5), logp(0, 0, 0, 1.0)]))
    values = {p: math.exp(v) for p, v in zip(paths(tree.tokens, tree.parents), tree.values)}
    assert values == pytest.approx({(0,): 0.6, (1,): 0.3, (2,): 0.1, (0, 0): 0.54, (0, 1): 0.06,
                                    (1, 2): 0.15, (1, 3): 0.15, (2, 3): 0.1})
    # the next frontier: the 4 best new nodes (0.54, 0.15, 0.15, 0.1), ties in creation order
    assert [paths(tree.tokens, tree.parents)[x] for x in tree.frontier] == [(0, 0), (1, 2), (1, 3), (2, 3)]
    nodes, parents = tree.head_query()
    assert nodes == [0, 1, 2, *tree.frontier] and parents == [-1, -1, -1, 0, 1, 1, 2]
    tokens, parents = tree.select(5)
    # (2,) and (2, 3) (0.1) lose to (1, 3) (0.15); kept nodes in creation (topological) order
    assert paths(tokens, parents) == [(0,), (1,), (0, 0), (1, 2), (1, 3)]


def test_equal_values_keep_the_parent():
    """A child as likely as its parent (probability 1): the shallower node ranks first, so a
    cut between them never keeps the child alone."""
    tree = DynamicTree(logp(0.5, 0.5), top_k=2)
    tree.expand(torch.stack([logp(1.0, 0), logp(1.0, 0)]))
    for total in range(1, 5):
        tokens, parents = tree.select(total)
        assert len(tokens) == total
        assert all(p < j for j, p in enumerate(parents))
        assert all(p == -1 or p < len(tokens) for p in parents)
        assert [len(p) for p in paths(tokens, parents)] == sorted(len(p) for p in paths(tokens, parents))


def test_draft_vocabulary_columns_map_to_tokens():
    tree = DynamicTree(logp(0.2, 0.8), top_k=1, token_ids=[17, 301])
    assert tree.tokens == [301]
    tree.expand(logp(0.9, 0.1)[None])
    assert tree.select(2) == ([301, 17], [-1, 0])
    with pytest.raises(ValueError, match="frontier"):
        tree.expand(torch.zeros(2, 2))
