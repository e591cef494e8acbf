"""``DraftRunner``: drive a draft model over mirrors of the target's sequences.

Each target sequence gets a *mirror* ``Sequence`` in the draft's own KV cache. On every
``propose`` the mirror is synced to the target's tokens: the K/V it computed stays valid
up to the longest common prefix (drafts the target rejected, or tokens it replaced, are
past it), so after a rejection the draft recomputes only from there. Then ``k`` draft
steps run, one batched forward each: the first catches the mirror up (the whole prompt
on its first call, usually one or two tokens later), the others compute one token.

Greedy requests take the draft's argmax; sampling requests draw from the draft's
distribution after the request's temperature / top-k / top-p / min-p, with the
request's generator, and the proposal carries those distributions for the verifier.
"""

from __future__ import annotations

import torch

from lmplug.api import (
    DraftProposal,
    ForwardRunner,
    KVCacheBackend,
    SamplingParams,
    ScheduledSeq,
    Sequence,
)
from lmplug.kit.sampling import draw, processed_logits

_MIRROR_PARAMS = SamplingParams(max_tokens=None)


class DraftRunner:
    def __init__(self, runner: ForwardRunner, kv: KVCacheBackend, target_vocab: int) -> None:
        self.runner = runner  # the core's runner over the draft model, bound to ``kv``
        self.kv = kv
        self.target_vocab = target_vocab
        self._mirrors: dict[int, Sequence] = {}  # target seq_id -> mirror

    def propose(self, seqs: list[Sequence], k: int) -> DraftProposal:
        pairs = [(s, self._sync(s)) for s in seqs]
        pairs = [(s, m) for s, m in pairs if self._fits(m, m.num_tokens + k - 1, seqs)]
        sampling = any(not s.params.is_greedy for s, _ in pairs)
        tokens: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        for _ in range(k if pairs else 0):
            logits = self._forward([m for _, m in pairs])
            chosen, q = self._choose(logits, [s for s, _ in pairs], sampling)
            for i, (seq, mirror) in enumerate(pairs):
                mirror.append_token(chosen[i])
                tokens[seq.seq_id].append(chosen[i])
                if q is not None:
                    probs[seq.seq_id].append(q[i])
        ids = [tokens[s.seq_id] for s in seqs]
        if not sampling:
            return DraftProposal(ids)
        return DraftProposal(ids, [torch.stack(probs[s.seq_id]) if probs[s.seq_id] else None
                                   for s in seqs])

    def release(self, seq: Sequence) -> None:
        mirror = self._mirrors.pop(seq.seq_id, None)
        if mirror is not None:
            self.kv.free(mirror)

    # -- internals ---------------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of ``seq`` holding its tokens, with K/V kept up to the common prefix."""
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(f"draft-{seq.request_id}", seq.token_ids, _MIRROR_PARAMS)
            self._mirrors[seq.seq_id] = mirror
            return mirror
        valid = common_prefix(mirror.token_ids, seq.token_ids, mirror.num_computed_tokens)
        mirror.reset_tokens(seq.token_ids, min(valid, seq.num_tokens - 1))
        self.kv.truncate(mirror, mirror.num_computed_tokens)
        return mirror

    def _fits(self, mirror: Sequence, num_tokens: int, active: list[Sequence]) -> bool:
        """Room for ``num_tokens``; mirrors of sequences not drafted now are dropped if needed."""
        if self.kv.can_allocate(mirror, num_tokens):
            return True
        keep = {s.seq_id for s in active}
        for seq_id in [i for i in self._mirrors if i not in keep]:
            self.kv.free(self._mirrors.pop(seq_id))
        return self.kv.can_allocate(mirror, num_tokens)

    def _forward(self, mirrors: list[Sequence]) -> torch.Tensor:
        """Compute every mirror's uncomputed tokens; logits [B, V] of their last tokens, in order."""
        batch = []
        for m in mirrors:
            cached = self.kv.allocate(m, m.num_tokens)
            if m.num_computed_tokens == 0 and cached:
                m.skip_cached(cached)
            batch.append(ScheduledSeq(m, m.num_tokens - m.num_computed_tokens))
        result = self.runner.execute(batch)
        for item in batch:
            item.seq.advance(item.num_new_tokens)
        row = {item.seq.seq_id: i for i, item in enumerate(result.sample_rows)}
        return result.logits[[row[m.seq_id] for m in mirrors]]

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence],
                sampling: bool) -> tuple[list[int], torch.Tensor | None]:
        return choose_tokens(logits, seqs, sampling, self.target_vocab)


def choose_tokens(logits: torch.Tensor, seqs: list[Sequence], sampling: bool,
                  vocab: int) -> tuple[list[int], torch.Tensor | None]:
    """Next draft token per sequence and, when sampling, the distributions drawn from."""
    logits = fit_vocab(logits.float(), vocab)
    if not sampling:
        return logits.argmax(-1).tolist(), None
    q = processed_logits(logits, [s.params for s in seqs]).softmax(-1)
    chosen = []
    for i, seq in enumerate(seqs):
        if seq.params.is_greedy:  # a point mass on the argmax: exact for the verifier too
            token = int(logits[i].argmax())
            q[i].zero_()[token] = 1
        else:
            token = draw(q[i], seq.generator)
        chosen.append(token)
    return chosen, q


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [B, Vd] over the target's vocabulary [B, vocab] (padded rows of a
    vocabulary are cut; ids the draft lacks get -inf)."""
    if logits.shape[-1] >= vocab:
        return logits[:, :vocab]
    pad = logits.new_full((logits.shape[0], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
