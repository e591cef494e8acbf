"""Draft-tree shapes: what a drafter proposing trees and the runner scoring them share.

Node ``j`` of a tree has parent ``parents[j]`` (``-1``: the root, the sequence's last accepted
token); parents come first (``parents[j] < j``). Scoring a tree puts node ``j`` at position
``start + depth(j)`` with an ancestor mask over the root and the nodes
(``lmplug.speculative.tree`` verifies trees; ``ScheduledSeq.positions`` / ``mask`` carry the
shape to the runner).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ancestor_mask", "depths", "is_chain", "tree_rows"]


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a root child has depth 1); checks the topological order."""
    out: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"draft tree: node {j} has parent {p}; parents must come first (-1 = root)")
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """bool ``[n + 1, n + 1]`` over the root (row/column 0) and the nodes (``j + 1``):
    ``mask[a, b]`` is True when ``b`` is ``a`` or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"draft tree: node {j} has parent {p}; parents must come first (-1 = root)")
        mask[j + 1] = mask[p + 1]
        mask[j + 1, j + 1] = True
    return mask


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))


def tree_rows(start: int, parents: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """What the runner needs to score a tree whose root sits at ``start``: the position of the
    root and of each node (``start + depth``), and the ancestor mask over them."""
    return [start] + [start + d for d in depths(parents)], ancestor_mask(parents)
