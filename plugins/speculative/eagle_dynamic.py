"""EAGLE-2's dynamic draft tree (Li et al., 2024, "EAGLE-2: Faster Inference of Language
Models with Dynamic Draft Trees"): grow the tree where the draft head is confident.

Each node carries a *value*: the sum of the draft log-probabilities along its path from the
root, the head's estimate of the chance that the target accepts the whole path. Growing
one sequence's tree (``DynamicTree``):

1. the head's distribution after the root gives the ``top_k`` depth-1 nodes;
2. *expand*: the ``top_k`` nodes of the newest depth (the frontier) go through the head
   together (one forward for the whole frontier, with tree attention over their ancestors);
   each gets its ``top_k`` most likely children, and of those ``top_k²`` new nodes the
   ``top_k`` of highest value form the next frontier. Repeat until the tree is ``depth``
   deep (``depth`` head forwards in all, as many as a chain of ``depth`` drafts);
3. *rerank*: of all nodes drafted, the ``total_tokens`` of highest value go to the target.
   A node's value never exceeds its parent's (log-probabilities are <= 0; ties go to the
   shallower node), so the chosen nodes always form a tree containing each one's parent.

The drafter (``eagle.py``) runs the head; this module only keeps the tree and decides.
Greedy requests only: a sampling request's proposal must be a chain drawn from the head's
distributions for speculative sampling to stay exact.
"""

from __future__ import annotations

import torch


class DynamicTree:
    """One sequence's growing draft tree. Nodes are numbered in creation order, which is a
    topological order (a node is created after its parent)."""

    def __init__(self, root_logprobs: torch.Tensor, top_k: int, token_ids: list[int] | None = None) -> None:
        """``root_logprobs`` [V']: the head's distribution after the root; its column c is token
        ``token_ids[c]`` (a draft vocabulary) or token c (``token_ids`` None)."""
        self.top_k = top_k
        self.token_ids = token_ids
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.values: list[float] = []
        self.depths: list[int] = []
        self.expanded: list[int] = []  # nodes already run through the head, in head-tree order
        self.frontier = self._add_children(-1, 0.0, root_logprobs)

    def head_query(self) -> tuple[list[int], list[int]]:
        """The nodes the head computes next, as (node ids, parent index within this list or -1):
        the expanded nodes, then the frontier (its rows are the last ``len(frontier)``)."""
        nodes = self.expanded + self.frontier
        where = {x: i for i, x in enumerate(nodes)}
        return nodes, [-1 if self.parents[x] < 0 else where[self.parents[x]] for x in nodes]

    def expand(self, logprobs: torch.Tensor) -> None:
        """``logprobs`` [len(frontier), V]: the head's distribution after each frontier node."""
        if logprobs.shape[0] != len(self.frontier):
            raise ValueError(f"eagle dynamic tree: {logprobs.shape[0]} rows for a frontier of {len(self.frontier)}")
        new: list[int] = []
        for row, node in enumerate(self.frontier):
            new.extend(self._add_children(node, self.values[node], logprobs[row]))
        self.expanded.extend(self.frontier)
        self.frontier = sorted(new, key=self._rank)[:self.top_k]

    def select(self, total: int) -> tuple[list[int], list[int]]:
        """The ``total`` nodes of highest value as (tokens, parents) in topological order,
        parents indexing the returned list (-1: the root)."""
        keep = sorted(sorted(range(len(self.tokens)), key=self._rank)[:total])
        where = {x: i for i, x in enumerate(keep)}
        parents = []
        for x in keep:
            p = self.parents[x]
            if p >= 0 and p not in where:  # cannot happen: values fall along a path (see module doc)
                raise RuntimeError(f"eagle dynamic tree: node {x} chosen without its parent {p}")
            parents.append(-1 if p < 0 else where[p])
        return [self.tokens[x] for x in keep], parents

    def _rank(self, node: int) -> tuple[float, int, int]:
        return (-self.values[node], self.depths[node], node)

    def _add_children(self, parent: int, value: float, logprobs: torch.Tensor) -> list[int]:
        """The ``top_k`` most likely next tokens after ``parent`` (finite log-probabilities only)."""
        lp, columns = logprobs.float().topk(min(self.top_k, logprobs.shape[-1]))
        depth = 1 if parent < 0 else self.depths[parent] + 1
        added = []
        for p, c in zip(lp.tolist(), columns.tolist()):
            if p == float("-inf"):
                break
            added.append(len(self.tokens))
            self.tokens.append(c if self.token_ids is None else self.token_ids[c])
            self.parents.append(parent)
            self.values.append(value + p)
            self.depths.append(depth)
        return added
