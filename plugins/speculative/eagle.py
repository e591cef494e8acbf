"""``eagle``: EAGLE-1/2 draft heads (Li et al., 2024): one decoder layer over the target's features.

Per target sequence the drafter keeps a *mirror* in a one-layer KV cache of the target's
KV class (so the target's attention backend reads it, contiguous or paged). Mirror
position t holds the pair (target feature at t, token t+1) — the features come from a
``FeatureStore`` that records the target's final hidden state at every computed position.

``propose`` (chain drafting, ``k`` tokens):

1. sync: the mirror's K/V stays valid up to the positions that were computed from the
   target's real features and whose tokens still match (drafts the target rejected, and
   the positions drafted from the head's own predicted features, lie past it);
2. catch up: one batched forward over each mirror's new positions (the whole prompt on the
   first call, then the tokens accepted last step) with real features; the output at the
   last position is the predicted next feature, the target's ``lm_head`` gives draft 1;
3. ``k - 1`` more single-token forwards, each feeding the predicted feature and the token
   just drafted.

With ``tree_width: w > 1`` a greedy request's proposal is a tree: the chain above plus, at
every depth, the ``w - 1`` runner-up tokens of the same draft step as leaves beside the
chain's node. They cost no extra head forward; the target verifies all of them in one
forward with tree attention (``lmplug.speculative.tree``). When it accepts a leaf, the
engine moves that node's K/V to the chain position and ``kv_moved`` moves its feature too.

With a draft vocabulary (``draft_vocab.safetensors`` beside the heads, written by the
trainer: the tokens the target actually produced) the draft logits come from those rows of
the ``lm_head`` only; tokens outside it are never drafted (probability 0 in ``q``, which
the verifier handles exactly). Greedy requests take the argmax; sampling requests draw from the filtered distribution with
the request's generator and return it in ``probs`` (the verifier stays exact either way).
Heads: ``heads: FOLDER`` in the published layout (``eagle_head.py``); train some with
``lmplug train-drafter --method eagle MODEL OUT`` (``eagle_train.py``). On the CPU in float32 at
one compute thread the head's layer runs through the native decode step where a forward fits it
(``eagle_native.py``: decodes, catch-ups of accepted tokens, tree steps), unless the engine keeps
steps in Python (``cpu.native_step: false``).
"""

from __future__ import annotations

import dataclasses

import torch
from lmplug_speculative.draft_runner import choose_tokens, common_prefix, fit_vocab
from lmplug_speculative.eagle_dynamic import DynamicTree
from lmplug_speculative.eagle_head import EagleHead, load_draft_vocab, load_head
from lmplug_speculative.eagle_native import native_layer
from lmplug_speculative.feature_store import FeatureStore
from lmplug_speculative.head_matrix import head_matrix
from pydantic import Field, model_validator

from lmplug.api import (
    Capabilities,
    Drafter,
    DrafterOptions,
    DraftProposal,
    DraftTarget,
    SamplingParams,
    ScheduledSeq,
    Sequence,
)
from lmplug.errors import ConfigError
from lmplug.kit.draft_tree import tree_rows

_MIRROR_PARAMS = SamplingParams(max_tokens=None)


class FeatureDraftOptions(DrafterOptions):
    """Options of a drafter that drafts from the target's features (EAGLE heads, MTP modules)."""

    tree_width: int = Field(default=1, ge=1, le=8, description="candidates per draft position for greedy "
                                                               "requests: the chain's token plus the next "
                                                               "tree_width - 1 most likely ones of the same "
                                                               "draft step as extra leaves, verified as a "
                                                               "tree (needs tree attention); 1: a chain")
    dynamic_tree: bool = Field(default=False, description="EAGLE-2 for greedy requests: grow a draft tree "
                                                          "num_tokens deep where the head is confident "
                                                          "(top_k nodes expanded per depth) and verify its "
                                                          "total_tokens most likely nodes (needs tree "
                                                          "attention); sampling requests keep the chain")
    top_k: int = Field(default=4, ge=1, le=16, description="dynamic_tree: nodes expanded per depth, and "
                                                           "children drafted per expanded node")
    total_tokens: int = Field(default=10, ge=1, le=63, description="dynamic_tree: draft nodes the target "
                                                                   "verifies per step")

    @model_validator(mode="after")
    def _one_tree_kind(self) -> FeatureDraftOptions:
        if self.dynamic_tree and self.tree_width > 1:
            raise ValueError("dynamic_tree and tree_width > 1 are two kinds of draft tree; choose one")
        return self


class EagleOptions(FeatureDraftOptions):
    heads: str = Field(description="folder with config.json and model.safetensors (or pytorch_model.bin) "
                                   "of EAGLE-1/2 heads")
    draft_vocab: bool = Field(default=True, description="draft only the tokens listed in the heads' "
                                                        "draft_vocab.safetensors, when present")


class EagleDrafter(Drafter):
    name = "eagle"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options = EagleOptions

    @property
    def drafts_trees(self) -> bool:
        return self.options.tree_width > 1 or self.options.dynamic_tree

    def setup(self, target: DraftTarget) -> None:
        self._open_head(target)
        self.vocab = target.model_config.vocab_size
        self._vocab_list = None if self._vocab_ids is None else self._vocab_ids.tolist()
        self.store = FeatureStore(target.model, target.kv, target.model_config.hidden_size, target.dtype,
                                  target.device)
        self.max_len = target.max_model_len
        self._mirrors: dict[int, _Mirror] = {}

    def _open_head(self, target: DraftTarget) -> None:
        """Build the head and its one-layer cache: sets ``kv``, ``runner``, ``_compute_logits`` and
        ``_vocab_ids`` (None: the whole vocabulary), and whatever ``_compute`` needs."""
        cfg = target.model_config
        head = load_head(self.options.heads, max_position=target.max_model_len + 64)
        hc = head.config
        if hc.hidden_size != cfg.hidden_size:
            raise ConfigError(f"speculative: eagle: heads {self.options.heads} have hidden_size "
                              f"{hc.hidden_size}, the target {cfg.hidden_size}")
        backend = _attention_backend(target)
        embed = head.embed_tokens if head.embed_tokens is not None else getattr(target.model, "embed_tokens", None)
        if embed is None:
            raise ConfigError("speculative: eagle: the heads have no embed_tokens and the target model exposes none")
        if head.embed_tokens is not None and head.embed_tokens.num_embeddings < cfg.vocab_size:
            raise ConfigError(f"speculative: eagle: the heads' embedding has {head.embed_tokens.num_embeddings} "
                              f"rows, the target's vocabulary {cfg.vocab_size}")
        self.head: EagleHead = head.to(target.device, target.dtype).eval()
        self._embed = embed
        self._compute_logits = target.model.compute_logits
        ids = load_draft_vocab(self.options.heads, cfg.vocab_size) if self.options.draft_vocab else None
        self._vocab_ids = None if ids is None else ids.to(target.device)
        if self._vocab_ids is not None:  # those rows of the lm_head, contiguous: one small matmul
            self._sub_head = head_matrix(target.model)[self._vocab_ids].contiguous()
        self.kv = target.new_kv_cache(1, num_kv_heads=hc.num_kv_heads, head_dim=hc.head_dim)
        self.attention = type(backend)(backend.options, num_heads=hc.num_heads, num_kv_heads=hc.num_kv_heads,
                                       head_dim=hc.head_dim, scale=hc.head_dim ** -0.5,
                                       sliding_window=cfg.sliding_window)
        self.runner = target.new_runner(_OneLayer(), self.kv)
        self.view = self.kv.layer_view(0)
        # the layer through the native decode step where the target's steps may run natively
        self._native = native_layer(self.head, self.attention) if getattr(
            target.model, "native_step_allowed", False) else None

    @classmethod
    def train(cls, host, model: str, out: str, options: dict) -> None:
        from lmplug_speculative.eagle_train import train_eagle

        train_eagle(host, model, out, options)

    def kv_moved(self, seq, src: list[int], dst: list[int]) -> None:
        self.store.move(seq, src, dst)  # an accepted sibling leaf's feature follows its K/V

    def release(self, seq) -> None:
        mirror = self._mirrors.pop(seq.seq_id, None)
        if mirror is not None:
            self.kv.free(mirror.seq)

    # -- drafting ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        if not hasattr(self, "runner"):
            raise RuntimeError("drafter 'eagle': setup(target) was not called")
        ids: list[list[int]] = [[] for _ in seqs]
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        sampling = any(not s.params.is_greedy for s in seqs)
        active = []  # (index in seqs, mirror, features of its new positions, steps it may draft)
        for i, seq in enumerate(seqs):
            steps = min(num_tokens, self.max_len - seq.num_tokens)
            c = seq.num_tokens - 1  # positions the target has computed (features known)
            if c < 1 or steps < 1:
                continue
            mirror = self._sync(seq)
            if not self._fits(mirror, mirror.seq.num_tokens + steps - 1, seqs):
                continue
            active.append((i, mirror, self.store.read(seq, mirror.seq.num_computed_tokens, c), steps))
        if not active:
            return DraftProposal(ids)
        # the first forward catches every mirror up; its last row drafts depth 1
        hidden = self._forward([m for _, m, _, _ in active], [f for _, _, f, _ in active])
        first = {i: hidden[b:b + 1] for b, (i, *_) in enumerate(active)}
        grow = [a for a in active if self.options.dynamic_tree and seqs[a[0]].params.is_greedy]
        parents: list[list[int] | None] | None = None
        if grow:
            parents = [None] * len(seqs)
            for (i, *_), (tokens, tree) in zip(grow, self._grow_trees(seqs, grow, first)):
                ids[i], parents[i] = tokens, tree
        grown = {i for i, *_ in grow}
        chains = [a for a in active if a[0] not in grown]
        feats = dict(first)  # per sequence: the features of the positions to compute next
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in chains}
        width = self.options.tree_width
        siblings: dict[int, list[list[int]]] = {i: [] for i, *_ in chains if seqs[i].params.is_greedy}
        for step in range(max((s for *_, s in chains), default=0)):
            live = [(i, m) for i, m, _, s in chains if s > step]
            hidden = (torch.cat([first[i] for i, _ in live]) if step == 0
                      else self._forward([m for _, m in live], [feats[i] for i, _ in live]))
            logits = self._logits(hidden)
            chosen, q = choose_tokens(logits, [seqs[i] for i, _ in live], sampling, self.vocab)
            alternatives = _runners_up(logits, chosen, width - 1, self.vocab) if width > 1 else None
            for b, (i, mirror) in enumerate(live):
                ids[i].append(chosen[b])
                mirror.seq.append_token(chosen[b])
                feats[i] = hidden[b:b + 1]  # the next position's feature: the head's prediction
                if q is not None:
                    q_rows[i].append(q[b])
                if alternatives is not None and i in siblings:
                    siblings[i].append(alternatives[b])
        if width > 1:
            parents = [None] * len(seqs)
            for i, alts in siblings.items():
                ids[i], parents[i] = _chain_with_siblings(ids[i], alts)
                q_rows[i] = []  # greedy: the tree verifier needs no draft distribution
        if sampling:
            for i, rows in q_rows.items():
                probs[i] = torch.stack(rows) if rows else None
            return DraftProposal(ids, probs, parents)
        return DraftProposal(ids, parents=parents)

    def _grow_trees(self, seqs, grow: list, first: dict[int, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
        """EAGLE-2 (``eagle_dynamic``): one head forward per further depth for all the trees at
        once. Each mirror computes its root position (the last target position: real feature,
        last accepted token) again, then every expanded node and the frontier, with a tree
        mask; node x's input is its parent's predicted feature (the root's: ``first``)."""
        opts = self.options
        trees = {i: DynamicTree(self._log_probs(first[i])[0], opts.top_k, self._vocab_list) for i, *_ in grow}
        outputs: dict[int, dict[int, torch.Tensor]] = {i: {} for i in trees}  # node -> predicted feature
        roots = {i: self.store.read(seqs[i], seqs[i].num_tokens - 2, seqs[i].num_tokens - 1) for i in trees}
        for depth in range(2, max(s for *_, s in grow) + 1):
            live = [(i, m) for i, m, _, s in grow if s >= depth and trees[i].frontier
                    and self._fits(m, m.real + len(trees[i].expanded) + len(trees[i].frontier), seqs)]
            if not live:
                break
            features = []
            for i, mirror in live:
                nodes, parents = trees[i].head_query()
                m = mirror.seq
                m.truncate_tokens(mirror.real)
                m.extend_tokens(trees[i].tokens[x] for x in nodes)
                m.rewind(mirror.real - 1)
                mirror.parents = parents
                inputs = [first[i] if trees[i].parents[x] < 0 else outputs[i][trees[i].parents[x]] for x in nodes]
                features.append(torch.cat([roots[i], *inputs]))
            out = self._forward([m for _, m in live], features, all_rows=True)
            for (i, mirror), rows in zip(live, out):
                mirror.parents = None
                frontier = trees[i].frontier
                for x, row in zip(frontier, rows[-len(frontier):]):
                    outputs[i][x] = row.unsqueeze(0)
                trees[i].expand(self._log_probs(rows[-len(frontier):]))
        results = []
        for i, mirror, _, _ in grow:  # the mirror keeps its real positions; the tree's slots are stale
            mirror.seq.truncate_tokens(mirror.real)
            mirror.seq.rewind(min(mirror.seq.num_computed_tokens, mirror.real))
            results.append(trees[i].select(opts.total_tokens))
        return results

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, V]; with a draft vocabulary only its tokens are finite."""
        if self._vocab_ids is None:
            return self._compute_logits(hidden)
        sub = hidden @ self._sub_head.T  # [B, N]
        out = sub.new_full((hidden.shape[0], self.vocab), float("-inf"))
        return out.index_copy_(1, self._vocab_ids, sub)

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [B, V'] over the draft vocabulary's columns (``_vocab_ids``),
        or over the whole vocabulary without one."""
        if self._vocab_ids is None:
            return torch.log_softmax(fit_vocab(self._compute_logits(hidden).float(), self.vocab), dim=-1)
        return torch.log_softmax((hidden @ self._sub_head.T).float(), dim=-1)

    def _sync(self, seq: Sequence) -> _Mirror:
        """The mirror of ``seq`` holding tokens 1..C (C = the target's computed length), its K/V
        kept where it came from real features and matching tokens, at least one position left
        to compute (the last one's output drafts the first token)."""
        c = seq.num_tokens - 1
        target_tokens = seq.token_ids[1:c + 1]
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = _Mirror(Sequence(f"eagle-{seq.request_id}", target_tokens, _MIRROR_PARAMS))
            self._mirrors[seq.seq_id] = mirror
        valid = common_prefix(mirror.seq.token_ids, target_tokens, mirror.real)
        mirror.seq.reset_tokens(target_tokens, min(valid, c - 1))
        self.kv.truncate(mirror.seq, mirror.seq.num_computed_tokens)
        mirror.real = c
        return mirror

    def _fits(self, mirror: _Mirror, num_tokens: int, active: list) -> bool:
        if self.kv.can_allocate(mirror.seq, num_tokens):
            return True
        keep = {s.seq_id for s in active}
        for seq_id in [i for i in self._mirrors if i not in keep]:
            self.kv.free(self._mirrors.pop(seq_id).seq)
        return self.kv.can_allocate(mirror.seq, num_tokens)

    def _forward(self, mirrors: list[_Mirror], features: list[torch.Tensor], all_rows: bool = False):
        """Compute each mirror's uncomputed positions with ``features`` ([n_i, h] each); returns
        the head's output [B, h] at each mirror's last position (``all_rows``: a list of each
        mirror's outputs [n_i, h])."""
        order = sorted(range(len(mirrors)), key=lambda j: not (
            mirrors[j].seq.num_tokens - mirrors[j].seq.num_computed_tokens == 1
            and mirrors[j].seq.num_computed_tokens > 0))  # decodes first, as the runner orders them
        batch = []
        for j in order:
            m, parents = mirrors[j].seq, mirrors[j].parents
            self.kv.allocate(m, m.num_tokens)
            n = m.num_tokens - m.num_computed_tokens
            if parents is None:
                batch.append(ScheduledSeq(m, n))
            else:  # a tree's nodes: positions by depth, an ancestor mask
                positions, mask = tree_rows(m.num_computed_tokens, parents)
                batch.append(ScheduledSeq(m, n, positions=positions, mask=mask))
        input_ids, ctx = self.runner.build_context(batch)
        out = self._compute(input_ids, torch.cat([features[j] for j in order]), ctx)
        for item in batch:
            item.seq.advance(item.num_new_tokens)
        if all_rows:
            cu = ctx.cu_query_lens.tolist()
            rows_of = [out[cu[b]:cu[b + 1]] for b in range(len(batch))]
            result: list[torch.Tensor] = [None] * len(mirrors)  # type: ignore[list-item]
            for b, j in enumerate(order):
                result[j] = rows_of[b]
            return result
        last = (ctx.cu_query_lens[1:] - 1).long()
        rows = torch.empty(len(mirrors), dtype=torch.long)
        rows[torch.tensor(order)] = last.cpu()
        return out[rows.to(out.device)]


    def _compute(self, input_ids: torch.Tensor, features: torch.Tensor, ctx) -> torch.Tensor:
        """The head's output at each position of ``ctx`` from (token, feature) pairs."""
        x = self.head.fuse(self._embed(input_ids), features)
        if self._native is not None and self._native.fits(x, ctx):
            out = self._native.run(x, ctx.positions, ctx, [self.view])  # None: the attention declined it
            if out is not None:
                return out
        return self.head.layer(x, ctx.positions, lambda q, k, v: self.attention.forward(0, q, k, v, self.view, ctx))


def _runners_up(logits: torch.Tensor, chosen: list[int], n: int, vocab: int) -> list[list[int]]:
    """Per row, the ``n`` most likely draft tokens after the chosen one (finite logits only)."""
    logits = fit_vocab(logits.float(), vocab)
    values, tokens = logits.topk(min(n + 1, logits.shape[-1]), dim=-1)
    return [[t for t, v in zip(row_t, row_v) if t != c and v != float("-inf")][:n]
            for row_t, row_v, c in zip(tokens.tolist(), values.tolist(), chosen)]


def _chain_with_siblings(chain: list[int], alternatives: list[list[int]]) -> tuple[list[int], list[int]]:
    """A draft tree: the chain (node d's parent d - 1, the root's -1), then each depth's
    alternatives as leaves beside the chain's node there (children of its parent)."""
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    for depth, alts in enumerate(alternatives):
        tokens.extend(alts)
        parents.extend([depth - 1] * len(alts))
    return tokens, parents


@dataclasses.dataclass
class _Mirror:
    seq: Sequence
    real: int = 0  # leading positions computed from the target's own features
    parents: list[int] | None = None  # while an EAGLE-2 tree grows: its nodes' parents (draft_tree)


class _OneLayer(torch.nn.Module):
    """What the core's runner (``DraftTarget.new_runner``) needs of a model to build contexts
    for the one-layer draft cache."""

    config = dataclasses.make_dataclass("Cfg", [("num_layers", int, 1)])()

    def bind_kv(self, views: list) -> None:
        self.views = views


def _attention_backend(target: DraftTarget):
    """The target's attention backend, whose class (and options) the head's attention uses."""
    backend = target.attention
    if backend is None:
        raise ConfigError(f"speculative: eagle: the target model {type(target.model).__name__} has no "
                          f"attention backend the head could use")
    if getattr(backend, "forward_mla", None) is not None and "mla" in backend.capabilities.features:
        raise ConfigError("speculative: eagle: MLA targets are not supported")
    return backend
