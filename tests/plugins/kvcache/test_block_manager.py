"""The paged KV cache's accounting (``BlockManager``): refcounts, prefix cache, LRU, copy-on-write.

The property test drives random interleavings of add / compute / append /
fork / free against a simulated cache whose every slot records *which
prefix* its K/V was computed from; reading a slot that holds anything but the
sequence's own prefix means a double allocation, a missed copy-on-write or a
prefix hit on a block that was never written.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lmplug_kvcache.block_manager import BlockManager, OutOfBlocksError


class _Seq:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.num_computed = 0


class BlockManagerMachine(RuleBasedStateMachine):
    """A model of the engine's use: allocate before a step, write K/V in it, then count it computed."""

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]),
                prefix_caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.bs = block_size
        self.seqs: dict[int, _Seq] = {}
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix written
        self.next_id = 0

    # -- helpers -----------------------------------------------------------------------------
    def _slot(self, sid: int, pos: int) -> tuple[int, int]:
        return self.bm.block_table(sid)[pos // self.bs], pos % self.bs

    def _allocate(self, sid: int, num_tokens: int) -> int:
        seq = self.seqs[sid]
        alloc = self.bm.allocate(sid, seq.tokens, num_tokens, seq.num_computed)
        for src, dst in alloc.copies:
            for off in range(self.bs):
                if (src, off) in self.content:
                    self.content[(dst, off)] = self.content[(src, off)]
        first = max(seq.num_computed, alloc.num_cached_tokens)
        for pos in range(first, num_tokens):  # the slots the step will write are ours alone
            assert self.bm.ref_count(self._slot(sid, pos)[0]) == 1
        return alloc.num_cached_tokens

    def _pending(self) -> list[int]:
        return sorted(s for s, q in self.seqs.items() if q.num_computed < len(q.tokens))

    def _idle(self) -> list[int]:
        return sorted(s for s, q in self.seqs.items() if q.num_computed == len(q.tokens))

    # -- rules -------------------------------------------------------------------------------
    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def add(self, prompt: list[int]) -> None:
        sid, self.next_id = self.next_id, self.next_id + 1
        seq = self.seqs[sid] = _Seq(prompt)
        if not self.bm.can_allocate(sid, prompt, len(prompt), 0):
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(sid, prompt, len(prompt), 0)
            del self.seqs[sid]
            return
        cached = self._allocate(sid, len(prompt))
        assert cached % self.bs == 0 and cached < len(prompt)
        for pos in range(cached):  # a hit serves only K/V written for this very prefix
            assert self.content[self._slot(sid, pos)] == tuple(prompt[:pos + 1])
        seq.num_computed = cached

    @precondition(lambda self: self._pending())
    @rule(data=st.data())
    def compute(self, data) -> None:
        sid = data.draw(st.sampled_from(self._pending()))
        seq = self.seqs[sid]
        for pos in range(seq.num_computed, len(seq.tokens)):
            self.content[self._slot(sid, pos)] = tuple(seq.tokens[:pos + 1])
        seq.num_computed = len(seq.tokens)

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), token=st.integers(0, 1))
    def append(self, data, token: int) -> None:
        sid = data.draw(st.sampled_from(self._idle()))
        seq = self.seqs[sid]
        seq.tokens.append(token)
        if self.bm.can_allocate(sid, seq.tokens, len(seq.tokens), seq.num_computed):
            self._allocate(sid, len(seq.tokens))
        else:
            seq.tokens.pop()

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self._idle()))
        sid, self.next_id = self.next_id, self.next_id + 1
        child = self.seqs[sid] = _Seq(self.seqs[parent].tokens)
        child.num_computed = self.seqs[parent].num_computed
        self.bm.fork(parent, sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs.pop(sid)
        self.bm.free(sid, seq.tokens, seq.num_computed)

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def refcounts_match_tables(self) -> None:
        if not hasattr(self, "bm"):
            return
        counts = [0] * self.bm.num_blocks
        for sid in self.seqs:
            for block in self.bm.block_table(sid):
                counts[block] += 1
        assert [self.bm.ref_count(b) for b in range(self.bm.num_blocks)] == counts
        free, cached = self.bm.free_block_ids, self.bm.cached_block_ids
        assert len(set(free)) == len(free) and len(set(cached)) == len(cached)
        assert not set(free) & set(cached)
        unreferenced = {b for b in range(self.bm.num_blocks) if counts[b] == 0}
        assert set(free) | set(cached) == unreferenced
        assert self.bm.num_used_blocks == self.bm.num_blocks - len(unreferenced)

    @invariant()
    def computed_tokens_hold_their_prefix(self) -> None:
        for sid, seq in getattr(self, "seqs", {}).items():
            for pos in range(seq.num_computed):
                assert self.content[self._slot(sid, pos)] == tuple(seq.tokens[:pos + 1])

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for sid, seq in list(self.seqs.items()):
            self.bm.free(sid, seq.tokens, seq.num_computed)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerProperties = BlockManagerMachine.TestCase


# -- specific behaviours ------------------------------------------------------------------------


def _run(bm: BlockManager, sid: int, tokens: list[int]) -> int:
    """Allocate a new sequence and count all its tokens computed; returns the cache hit."""
    hit = bm.allocate(sid, tokens, len(tokens), 0).num_cached_tokens
    return hit


def test_a_salt_keeps_prefixes_apart():
    """A LoRA adapter's ``cache_salt`` starts the hash chain: the same tokens under another salt
    (or none) never hit, under the same salt they do, and a fork keeps its parent's salt."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10))
    for sid, salt in enumerate((7, None, 8)):
        assert bm.allocate(sid, prompt, len(prompt), 0, salt).num_cached_tokens == 0
        bm.free(sid, prompt, len(prompt))
    assert bm.can_allocate(3, prompt + [1], 11, 0, 8)
    assert bm.allocate(3, prompt + [1], 11, 0, 8).num_cached_tokens == 8
    bm.fork(3, 4)
    bm.free(3, prompt + [1], 11)
    tail = prompt + [1] + list(range(20, 26))  # the fork registers its next block under salt 8 too
    bm.allocate(4, tail, len(tail), 11)
    bm.free(4, tail, len(tail))
    assert bm.allocate(5, tail + [0], len(tail) + 1, 0, 8).num_cached_tokens == 16
    assert bm.allocate(6, tail + [0], len(tail) + 1, 0, 9).num_cached_tokens == 0


def test_prefix_hit_reuses_full_computed_blocks_only():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(10))  # blocks [0..3], [4..7], and a partial one
    assert _run(bm, 0, prompt) == 0
    # not computed yet: a second request must not be served the unwritten blocks
    assert _run(bm, 1, prompt) == 0
    bm.free(1, prompt, 0)
    bm.free(0, prompt, len(prompt))  # computed now: the two full blocks are registered
    assert len(bm.cached_block_ids) == 2
    assert _run(bm, 2, prompt + [99]) == 8
    assert bm.block_table(2)[:2] == [bm.block_table(2)[0], bm.block_table(2)[1]]
    assert bm.cached_block_ids == []  # both hits were taken out of the LRU


def test_prefix_hit_never_covers_the_last_token():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(8))  # exactly two full blocks
    _run(bm, 0, prompt)
    bm.free(0, prompt + [8], 8)
    # the whole prompt is cached, but its last token's logits are needed: the last block is recomputed
    assert _run(bm, 1, prompt) == 4
    assert bm.ref_count(bm.block_table(1)[1]) == 1


def test_lru_evicts_least_recently_used_cached_block_first():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    prompts = {sid: [sid, sid, 7] for sid in range(3)}  # one full block each (+ one token)
    for sid, p in prompts.items():
        _run(bm, sid, p)
    blocks = {sid: bm.block_table(sid)[0] for sid in prompts}
    for sid in (1, 0, 2):  # released in this order: LRU order 1, 0, 2 (the partial tails go free)
        bm.free(sid, prompts[sid], 3)
    assert bm.cached_block_ids == [blocks[1], blocks[0], blocks[2]]
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0
    # a new 8-token sequence needs 4 blocks: the 3 free ones first, then the LRU victim (seq 1's)
    _run(bm, 10, [5] * 8)
    assert bm.cached_block_ids == [blocks[0], blocks[2]]
    bm.free(10, [5] * 8, 0)
    assert _run(bm, 11, prompts[1]) == 0  # evicted
    assert _run(bm, 12, prompts[0]) == 2  # still cached


def test_cached_blocks_count_as_free_and_are_evicted_only_when_needed():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    _run(bm, 0, [1, 2, 3])
    bm.free(0, [1, 2, 3], 3)
    assert bm.cached_block_ids and bm.num_free_blocks == 3 and bm.num_used_blocks == 0
    _run(bm, 1, [9, 9])  # one block: taken from the never-used free list, cache untouched
    assert len(bm.cached_block_ids) == 1


def test_copy_on_write_copies_only_the_shared_partial_block():
    bm = BlockManager(8, 4)
    tokens = list(range(10))  # blocks: full, full, partial (2 tokens)
    bm.allocate(0, tokens, 10, 0)
    parent = list(bm.block_table(0))
    bm.fork(0, 1)
    assert [bm.ref_count(b) for b in parent] == [2, 2, 2]
    alloc = bm.allocate(0, tokens + [10], 11, 10)  # the parent writes position 10, in the partial block
    assert len(alloc.copies) == 1 and alloc.copies[0][0] == parent[2]
    assert bm.block_table(0)[:2] == parent[:2] and bm.block_table(0)[2] == alloc.copies[0][1]
    assert bm.allocate(1, tokens + [11], 11, 10).copies == []  # the child now owns the old block
    assert bm.block_table(1) == parent
    assert [bm.ref_count(b) for b in parent] == [2, 2, 1]


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(8, 4)
    tokens = list(range(8))
    bm.allocate(0, tokens, 8, 0)
    bm.fork(0, 1)
    for sid in (0, 1):
        alloc = bm.allocate(sid, tokens + [sid], 9, 8)
        assert alloc.copies == []
    assert bm.block_table(0)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(0)[2] != bm.block_table(1)[2]
    for sid in (0, 1):
        bm.free(sid)
    assert bm.num_free_blocks == 8


def test_out_of_blocks_is_reported_not_corrupting():
    bm = BlockManager(2, 4)
    assert not bm.can_allocate(0, list(range(9)), 9, 0)
    with pytest.raises(OutOfBlocksError, match="needs 3 more blocks"):
        bm.allocate(0, list(range(9)), 9, 0)
    assert bm.num_free_blocks == 2 and not bm.has_seq(0)
