"""Tree speculative decoding: draft trees, their attention masks, greedy verification, the KV move.

A drafter may propose a *tree* of candidates instead of a chain (``DraftProposal.parents``):
node ``j`` has parent ``parents[j]`` (``-1``: the root, the sequence's last accepted token)
and nodes are in topological order (``parents[j] < j``). The target scores the root and
every node in one forward: node ``j`` sits at position ``start + depth(j)`` and attends to
the cached context ``[0, start)`` plus its ancestors and itself (the *tree mask*), so its
logits are exactly those a chain of its root-to-``j`` path would get. Its K/V is written at
the slot of sequence position ``start + j`` (node order, as a chain's draft ``j`` would be).

Verification (greedy only; sampling requests are cut to a chain, see ``first_child_chain``)
walks from the root: the target's argmax after node ``x`` is accepted when a child of ``x``
carries it, else it is emitted as the correction; at a leaf the argmax is the bonus token.
Then the K/V of the accepted nodes ``j_1..j_m`` (depths ``1..m``) moves from positions
``start + j_d`` to ``start + d`` (``move_kv``), where a chain would have put them, and the
usual rollback truncates the cache to the accepted length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmplug.kit.draft_tree import is_chain
from lmplug.kit.kv_layout import kv_slots


def first_child_chain(parents: Sequence[int]) -> list[int]:
    """The nodes of node 0's path: the root's first child, its first child, and so on."""
    chain: list[int] = []
    at = -1
    for j, p in enumerate(parents):
        if p == at:
            chain.append(j)
            at = j
    return chain


def subtree(parents: Sequence[int], keep: Sequence[int]) -> list[int]:
    """The parents of the nodes ``keep`` (ascending, closed under parents), renumbered."""
    index = {j: i for i, j in enumerate(keep)}
    out = []
    for j in keep:
        p = parents[j]
        if p >= 0 and p not in index:
            raise ValueError(f"draft tree: kept node {j} without its parent {p}")
        out.append(-1 if p < 0 else index[p])
    return out


@dataclass(frozen=True)
class TreeVerdict:
    tokens: list[int]  # the accepted path's tokens, then the target's correction or bonus
    nodes: list[int]  # the accepted nodes, root to leaf (depths 1..m)
    rows: list[int]  # the logits row (0 = root, j + 1 = node j) that chose each emitted token


def verify_tree_greedy(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]) -> TreeVerdict:
    """logits ``[n + 1, V]`` (row 0: after the root, row ``j + 1``: after node ``j``): follow the
    target's argmax down the tree. Among siblings carrying the same token the first wins."""
    if logits.shape[0] != len(tokens) + 1 or len(tokens) != len(parents):
        raise ValueError(f"verify_tree_greedy: {len(tokens)} nodes, {len(parents)} parents need "
                         f"{len(tokens) + 1} logits rows, got {logits.shape[0]}")
    best = logits.argmax(-1).tolist()
    children: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        children.setdefault(p, []).append(j)
    emitted, nodes, rows = [], [], []
    at = -1
    while True:
        want = best[at + 1]
        emitted.append(want)
        rows.append(at + 1)
        nxt = next((c for c in children.get(at, ()) if tokens[c] == want), None)
        if nxt is None:
            return TreeVerdict(emitted, nodes, rows)
        nodes.append(nxt)
        at = nxt


def head(parents: Sequence[int] | None, keep: int) -> list[int] | None:
    """The first ``keep`` nodes of a tree (a topological order's head is a subtree); None when
    they form a chain, which needs no tree attention."""
    if parents is None or is_chain(parents[:keep]):
        return None
    return list(parents[:keep])


def move_kv(kv, seq, src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy the K/V (and scales, for a quantized cache) at sequence positions ``src`` to positions
    ``dst`` in every layer, through ``kv.block_table(seq)``. Generic over the layouts: every view
    is ``[rows_or_blocks, slots, ...]`` addressed as ``table[p // block_size] * block_size +
    p % block_size`` (the runner's slot formula; the contiguous ring uses it too).

    The destinations ``start + 1 .. start + m`` were written this step, so under prefix caching
    their blocks were made private when the step allocated them (copy-on-write covers every
    position a step writes) and no other sequence sees the move.
    """
    pairs = [(s, d) for s, d in zip(src, dst) if s != d]
    if not pairs:
        return
    table = torch.tensor(kv.block_table(seq), dtype=torch.long)
    s_idx = kv_slots(table, torch.tensor([s for s, _ in pairs]), kv.block_size)
    d_idx = kv_slots(table, torch.tensor([d for _, d in pairs]), kv.block_size)
    for layer in range(kv.spec.num_layers):
        view = kv.layer_view(layer)
        for t in (view.k_cache, view.v_cache, view.k_scale, view.v_scale):
            if t is None or t.numel() == 0:
                continue  # no scales, or the latent layout's empty V
            flat = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # no float8 index_put on CPU
            flat = flat.view(-1, *t.shape[2:])
            dev = flat.device
            flat[d_idx.to(dev)] = flat[s_idx.to(dev)]  # the gather copies first: overlaps are safe
