"""``medusa``: extra decoding heads on the target's last hidden state (Cai et al., 2024).

After each step the engine hands this drafter (``observe``) the target's final hidden
state at every sequence's last computed position; from it head ``i`` proposes token
``i + 1`` after the sequence's last token, all heads in one batched pass — no draft
model, no draft KV cache. Candidates form a chain (each head's top choice, or a sample
from its filtered distribution for sampling requests, returned as ``probs``), or, with
the option ``tree``, a tree for greedy requests: Medusa's "choices", each a path of top-k
ranks — the node at path ``(r_1, ..., r_d)`` carries the token of rank ``r_d`` in head
``d - 1``'s logits — verified in one forward with tree attention (``lmplug.speculative.tree``;
the attention backend must list the "tree_attention" feature). Sampling requests keep the
sampled chain (speculative sampling stays exact); ``num_tokens`` bounds only that chain.

Heads load from the FasterDecoding format (``medusa_heads.py``); train some for any
model with ``lmplug train-drafter --method medusa MODEL OUT`` (``medusa_train.py``).
When a head's output matrix equals the target's ``lm_head`` (heads trained here keep it
frozen), the target's head is used, so all heads share one matrix multiply.
"""

from __future__ import annotations

import torch
from lmplug_speculative.head_matrix import plain_head
from lmplug_speculative.medusa_heads import MedusaHeads, load_heads
from pydantic import Field, field_validator

from lmplug.api import Capabilities, Drafter, DrafterOptions, DraftProposal, DraftTarget
from lmplug.errors import ConfigError
from lmplug.kit.sampling import draw, processed_logits

# FasterDecoding's Medusa choices ``mc_sim_7b_63`` (medusa/model/medusa_choices.py), in its order
MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
                [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2],
                [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1],
                [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3],
                [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
                [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
                [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]
# preset trees, cut to the heads' count at setup (paths deeper than the heads are dropped)
TREE_PRESETS = {"default": MC_SIM_7B_63[:16], "mc_sim_7b_63": MC_SIM_7B_63}
MAX_TREE_NODES = 64
MAX_TREE_RANK = 32  # ranks index a per-head top-k of at most this many tokens


class MedusaOptions(DrafterOptions):
    heads: str = Field(description="folder with medusa_lm_head.safetensors (or .pt) and config.json")
    tree: list[list[int]] | str | None = Field(
        default=None,
        description="tree candidates for greedy requests (needs tree attention: sdpa, or paged with "
                    "torch kernels): Medusa choices, paths of top-k ranks such as [[0], [1], [0, 0]] (node "
                    "(r_1..r_d) = rank r_d of head d-1; every prefix listed; depth <= heads; ranks < "
                    f"{MAX_TREE_RANK}; <= {MAX_TREE_NODES} nodes), or a preset: "
                    f"{', '.join(TREE_PRESETS)} (default: the first 16 of mc_sim_7b_63); None: a chain")

    @field_validator("tree")
    @classmethod
    def _valid_tree(cls, value):
        if value is None:
            return None
        if isinstance(value, str):
            if value not in TREE_PRESETS:
                raise ValueError(f"unknown tree preset {value!r} (presets: {', '.join(TREE_PRESETS)}; or a "
                                 "list of rank paths such as [[0], [1], [0, 0]])")
            return value
        check_tree(value)
        return value


class MedusaDrafter(Drafter):
    name = "medusa"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options = MedusaOptions
    uses_hidden_states = True

    @property
    def drafts_trees(self) -> bool:
        return self.options.tree is not None

    def setup(self, target: DraftTarget) -> None:
        heads = load_heads(self.options.heads)
        self._tree = tree_for_heads(self.options.tree, len(heads))
        cfg = target.model_config
        weight = heads.head_weights()[0]
        if weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ConfigError(f"speculative: medusa: heads {self.options.heads} output [{weight.shape[0]}, "
                              f"{weight.shape[1]}] but the target has vocab {cfg.vocab_size}, hidden "
                              f"{cfg.hidden_size}")
        self._shares_lm_head = _equals_lm_head(heads, target.model)  # (in the stored dtype)
        self.heads: MedusaHeads = heads.to(target.device, target.dtype).eval()
        self._compute_logits = target.model.compute_logits
        self._hidden: dict[int, tuple[torch.Tensor, int]] = {}  # seq_id -> (hidden [h], num_tokens)

    @classmethod
    def train(cls, host, model: str, out: str, options: dict) -> None:
        from lmplug_speculative.medusa_train import train_medusa

        train_medusa(host, model, out, options)

    def observe(self, seqs, hidden: torch.Tensor) -> None:
        for seq, row in zip(seqs, hidden):
            self._hidden[seq.seq_id] = (row, seq.num_tokens)

    def release(self, seq) -> None:
        self._hidden.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        k = min(num_tokens, len(self.heads))
        # a hidden state is usable only while the sequence still ends with the token it chose
        ready = [i for i, s in enumerate(seqs)
                 if self._hidden.get(s.seq_id, (None, -1))[1] == s.num_tokens]
        ids: list[list[int]] = [[] for _ in seqs]
        if not ready:
            return DraftProposal(ids)
        hidden = torch.stack([self._hidden[seqs[i].seq_id][0] for i in ready])  # [B, h]
        chosen = [seqs[i] for i in ready]
        if self._tree is not None and any(s.params.is_greedy for s in chosen):
            return self._propose_tree(seqs, ready, hidden, k)
        logits = self._head_logits(self.heads.blocks(hidden, k)).float()  # [k, B, V]
        if all(s.params.is_greedy for s in chosen):
            for b, i in enumerate(ready):
                ids[i] = logits[:, b].argmax(-1).tolist()
            return DraftProposal(ids)
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        for b, i in enumerate(ready):
            ids[i], probs[i] = _sample_chain(logits[:, b], seqs[i])
        return DraftProposal(ids, probs)

    def _propose_tree(self, seqs, ready: list[int], hidden: torch.Tensor, k: int) -> DraftProposal:
        """Greedy sequences get the tree, sampling ones the sampled chain of ``k`` heads."""
        tree = self._tree
        sampling = any(not seqs[i].params.is_greedy for i in ready)
        depth = max(tree.depth, k if sampling else 0)
        logits = self._head_logits(self.heads.blocks(hidden, depth)).float()  # [depth, B, V]
        ids: list[list[int]] = [[] for _ in seqs]
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        parents: list[list[int] | None] = [None] * len(seqs)
        top = logits[:tree.depth].topk(tree.top_k, dim=-1).indices  # [depth, B, top_k]
        for b, i in enumerate(ready):
            if seqs[i].params.is_greedy:
                ids[i] = top[tree.head, b, tree.rank].tolist()
                parents[i] = list(tree.parents)
            else:
                ids[i], probs[i] = _sample_chain(logits[:k, b], seqs[i])
        return DraftProposal(ids, probs if sampling else None, parents)

    def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [k, B, h] -> [k, B, V] through each head's output matrix."""
        k, b, h = x.shape
        if self._shares_lm_head:
            return self._compute_logits(x.reshape(k * b, h)).view(k, b, -1)
        # one matmul per head: stacking the [V, h] matrices for a bmm would copy them every step
        return torch.stack([x[i] @ w.T for i, w in enumerate(self.heads.head_weights()[:k])])


def _sample_chain(logits: torch.Tensor, seq) -> tuple[list[int], torch.Tensor]:
    """One sequence's heads' logits [k, V] -> drafted tokens and the distributions drawn from."""
    q = processed_logits(logits, [seq.params] * logits.shape[0]).softmax(-1)
    if seq.params.is_greedy:  # a point mass on the argmax
        tokens = logits.argmax(-1).tolist()
        q = torch.zeros_like(q).scatter_(1, torch.tensor(tokens).unsqueeze(1), 1.0)
        return tokens, q
    return [draw(row, seq.generator) for row in q], q


class MedusaTree:
    """A validated tree of rank paths, in topological order: per node its parent (-1: the root),
    the head whose logits give its token (depth - 1) and its rank there."""

    def __init__(self, paths: list[list[int]]) -> None:
        self.paths = [tuple(p) for p in paths]
        index = {p: j for j, p in enumerate(self.paths)}
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]
        self.head = torch.tensor([len(p) - 1 for p in self.paths])
        self.rank = torch.tensor([p[-1] for p in self.paths])
        self.depth = max(len(p) for p in self.paths)
        self.top_k = 1 + max(p[-1] for p in self.paths)

    def __len__(self) -> int:
        return len(self.paths)


def check_tree(paths: list[list[int]]) -> None:
    """ValueError unless ``paths`` is a usable tree of rank paths (depth is checked at setup)."""
    if not paths:
        raise ValueError("empty; give at least one path such as [0], or leave it unset for a chain")
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"{len(paths)} nodes; at most {MAX_TREE_NODES}")
    seen = set()
    for path in paths:
        if not path:
            raise ValueError("an empty path []; every node is a path of ranks such as [0, 1]")
        if any(r < 0 or r >= MAX_TREE_RANK for r in path):
            raise ValueError(f"path {path}: ranks must be in [0, {MAX_TREE_RANK})")
        if tuple(path) in seen:
            raise ValueError(f"path {path} is listed twice")
        seen.add(tuple(path))
    for path in paths:
        if len(path) > 1 and tuple(path[:-1]) not in seen:
            raise ValueError(f"path {path} lacks its parent {path[:-1]} (every prefix must be listed)")


def tree_for_heads(tree: list[list[int]] | str | None, num_heads: int) -> MedusaTree | None:
    """The option resolved against the heads: a preset cut to ``num_heads`` levels; an explicit
    tree must fit them. Nodes keep the given order when parents come first, else sort by depth."""
    if tree is None:
        return None
    if isinstance(tree, str):
        paths = [p for p in TREE_PRESETS[tree] if len(p) <= num_heads]
    else:
        deep = [p for p in tree if len(p) > num_heads]
        if deep:
            raise ConfigError(f"speculative.tree: path {deep[0]} is {len(deep[0])} deep but the heads have "
                              f"only {num_heads} (a node at depth d uses head d-1)")
        paths = [list(p) for p in tree]
    position = {tuple(p): j for j, p in enumerate(paths)}
    if any(len(p) > 1 and position[tuple(p[:-1])] > j for j, p in enumerate(paths)):
        paths = sorted(paths, key=len)  # stable: the given order within each depth
    return MedusaTree(paths)


def _equals_lm_head(heads: MedusaHeads, model: torch.nn.Module) -> bool:
    head = plain_head(model)  # tied: the embedding's table; packed: None
    if head is None:
        return False
    return all(w.shape == head.shape and torch.equal(w, head.to(w.dtype)) for w in heads.head_weights())
