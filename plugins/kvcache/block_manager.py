"""``BlockManager``: the accounting side of the paged KV cache — no tensors here.

A pool of ``num_blocks`` blocks of ``block_size`` token slots. Each sequence
holds a block table (block ids in token order); each block has a reference
count (how many tables hold it). Three disjoint kinds of block:

- *free*: never hashed, unreferenced (handed out first);
- *cached*: unreferenced but holding the K/V of a full, computed block that a
  later request with the same prefix may reuse; kept in LRU order and evicted
  (least recently used first) only when no free block is left;
- *in use*: referenced by at least one table (``ref_count > 0``).

Prefix caching: a full block is identified by a hash chained over every
token before it, ``H(hash of the previous block, tokens of this block)`` (128-bit BLAKE2b,
so the same prefix gets the same hash in every process: a KV tier on disk outlives the
engine), so equal hashes mean equal prefixes (up to hash collisions). A block is
registered under its hash only once its tokens are *computed* (below the
sequence's ``num_computed_tokens``): ``allocate`` runs before the step that
writes the K/V, so registration waits for the next ``allocate`` or the
``free`` of that sequence. A block whose hash is already held by another block
stays unregistered and is freed normally.

Sliding window: with ``sliding_window=W`` no future query sees a key at a
position <= ``num_computed_tokens - W``, so leading blocks that lie wholly
below that are released as the sequence grows (its table keeps their ids in
place, so positions still map to ``table[p // block_size]``; attention never
reads them). Memory per sequence then stays bounded by the window.

A KV tier (``set_tier``, a KV connector behind the paged backend): a prefix's blocks past
the last one found in the pool are looked up in the tier too; ``allocate`` hands them out as
fresh blocks to fill (``Allocation.loads``), and only those the caller then reports loaded
(``loaded``) count as cached and are registered. Every block registered from a computation
is listed once in ``drain_registered()``, so the caller can write it through to the tier.

Copy-on-write: ``fork`` lets a child share all of its parent's blocks. When a
sequence is about to write into a block it shares, it gets a fresh block; if
that block already holds computed tokens the caller must copy it first (the
copies are returned by ``allocate``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class OutOfBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than the pool has free (check ``can_allocate`` first)."""


@dataclass
class Allocation:
    num_cached_tokens: int  # leading tokens whose K/V are already stored (prefix-cache hit)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks to copy now
    # (block, hash) of a prefix's blocks the KV tier holds: fill them, then report ``loaded``
    # (``num_cached_tokens`` counts them until then)
    loads: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chain hashes of the leading registered blocks
    num_dropped: int = 0  # leading blocks released because they left the sliding window
    salt: int | None = None  # what the first block's hash chains onto (a LoRA adapter's; None: none)

    @property
    def held(self) -> list[int]:
        """The blocks this sequence still references."""
        return self.table[self.num_dropped:]


def chain_hash(prev_hash: int | None, tokens: Sequence[int]) -> int:
    """The hash of a full block: its tokens chained onto the hash of the block before it
    (128-bit BLAKE2b of the previous hash and the token ids; the same in every process)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"-" if prev_hash is None else prev_hash.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[int, _SeqBlocks] = {}
        self._tier: Callable[[int], bool] | None = None  # "does the KV tier hold this hash"
        self._registered: list[tuple[int, int]] = []  # (block, hash) registered since the last drain

    def set_tier(self, contains: Callable[[int], bool]) -> None:
        """Look prefix blocks missing from the pool up in a KV tier (``contains(hash)``)."""
        if not self.enable_prefix_caching:
            raise ValueError("BlockManager.set_tier needs prefix caching")
        self._tier = contains

    def drain_registered(self) -> list[tuple[int, int]]:
        """(block, hash) of every block registered from a computation since the last call."""
        out, self._registered = self._registered, []
        return out

    def loaded(self, seq_id: int, loads: list[tuple[int, int]]) -> int:
        """Register the leading ``loads`` of ``seq_id``'s last ``Allocation`` that were filled
        from the tier; returns the sequence's cached tokens (pool hits + these)."""
        seq = self._seqs[seq_id]
        for block, h in loads:
            seq.hashes.append(h)
            if h not in self._hash_to_block:
                self._block_hash[block] = h
                self._hash_to_block[h] = block
        return len(seq.hashes) * self.block_size

    # -- state ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: free plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def held_counts(self) -> list[int]:
        """How many blocks each sequence references (``layer_groups``' accounting)."""
        return [len(seq.held) for seq in self._seqs.values()]

    @property
    def free_block_ids(self) -> list[int]:
        return list(self._free)

    @property
    def cached_block_ids(self) -> list[int]:
        """Unreferenced cached blocks, least recently used first (the eviction order)."""
        return list(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def block_hash(self, block: int) -> int | None:
        return self._block_hash[block]

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].table

    # -- allocation -----------------------------------------------------------------------
    def can_allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                     num_computed: int, salt: int | None = None) -> bool:
        """Whether ``seq_id`` can grow to ``num_tokens`` tokens with the blocks free now."""
        return self._num_blocks_taken(seq_id, token_ids, num_tokens, num_computed, salt) <= self.num_free_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                 num_computed: int, salt: int | None = None) -> Allocation:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; the step then writes
        tokens ``[num_computed, num_tokens)``.

        On a sequence's first allocation, full blocks of its prefix found in the
        cache are reused (never the block of its last token, whose logits must be
        computed) and their count in tokens is returned. ``salt`` (a LoRA adapter's
        ``cache_salt``) starts the hash chain: prefixes match only under the same salt.
        """
        need = self._num_blocks_taken(seq_id, token_ids, num_tokens, num_computed, salt)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(f"paged KV cache: sequence {seq_id} needs {need} more blocks of "
                                   f"{self.block_size} tokens but only {self.num_free_blocks} of "
                                   f"{self.num_blocks} are free")
        first = seq_id not in self._seqs
        seq = self._seqs.setdefault(seq_id, _SeqBlocks(salt=salt))
        num_cached, loads = 0, []
        if first:
            num_cached, loads = self._take_prefix_hits(seq, token_ids)
            num_computed = max(num_computed, num_cached)
        else:
            self._register_computed(seq, token_ids, num_computed)
            self._drop_out_of_window(seq, num_computed)
        copies = self._unshare_write_blocks(seq, num_computed, num_tokens)
        while len(seq.table) * self.block_size < num_tokens:
            seq.table.append(self._take_fresh())
        return Allocation(num_cached, copies, loads)

    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` shares every block of ``parent_id`` (copy-on-write)."""
        if child_id in self._seqs:
            raise ValueError(f"BlockManager.fork: sequence {child_id} already holds blocks")
        parent = self._seqs[parent_id]
        for block in parent.held:
            self._ref_counts[block] += 1
        self._seqs[child_id] = _SeqBlocks(list(parent.table), list(parent.hashes), parent.num_dropped, parent.salt)

    def free(self, seq_id: int, token_ids: Sequence[int] = (), num_computed: int = 0) -> None:
        """Drop ``seq_id``'s references; its computed full blocks stay cached (prefix caching).

        Blocks are released tail first, so a sequence's later blocks are evicted
        before its earlier ones (more requests share a prefix's head than its tail).
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._register_computed(seq, token_ids, num_computed)
        for block in reversed(seq.held):
            self._release(block)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Release ``seq_id``'s blocks wholly past its first ``num_tokens`` tokens.

        Used to roll back rejected speculative tokens. The released blocks hold only
        uncomputed (rejected) slots, so they were never registered in the prefix cache and
        go back to the free list (a shared one just loses this reference).
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        keep = -(-num_tokens // self.block_size)
        while len(seq.table) > keep:
            self._release(seq.table.pop())
        del seq.hashes[keep:]

    # -- internals ------------------------------------------------------------------------
    def _num_blocks_taken(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                          num_computed: int, salt: int | None = None) -> int:
        """Blocks this allocation takes out of the free + cached pool."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            hits, _ = self._find_prefix_hits(token_ids, salt)
            num_new = max(0, -(-num_tokens // self.block_size) - len(hits))
            return num_new + sum(1 for b in hits if self._ref_counts[b] == 0)
        num_new = max(0, -(-num_tokens // self.block_size) - len(seq.table))
        return num_new + len(self._shared_write_blocks(seq, num_computed, num_tokens))

    def _find_prefix_hits(self, token_ids: Sequence[int], salt: int | None = None) -> tuple[list[int], list[int]]:
        """(blocks of the pool holding the prefix's leading full blocks, hashes of the full
        blocks after them that the tier holds)."""
        if not self.enable_prefix_caching:
            return [], []
        hits: list[int] = []
        tiered: list[int] = []
        prev = salt
        # the last token is never served from the cache: its logits are needed
        for i in range((len(token_ids) - 1) // self.block_size):
            prev = chain_hash(prev, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = None if tiered else self._hash_to_block.get(prev)
            if block is not None:
                hits.append(block)
            elif self._tier is not None and self._tier(prev):
                tiered.append(prev)
            else:
                break
        return hits, tiered

    def _take_prefix_hits(self, seq: _SeqBlocks, token_ids: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        hits, tiered = self._find_prefix_hits(token_ids, seq.salt)
        for block in hits:
            if self._ref_counts[block] == 0:
                del self._cached[block]
            self._ref_counts[block] += 1
            seq.table.append(block)
            seq.hashes.append(self._block_hash[block])
        loads = []
        for h in tiered:
            block = self._take_fresh()
            seq.table.append(block)
            loads.append((block, h))
        return len(seq.table) * self.block_size, loads

    def _register_computed(self, seq: _SeqBlocks, token_ids: Sequence[int], num_computed: int) -> None:
        """Register every full block whose tokens are all computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed // self.block_size, len(seq.table), len(token_ids) // self.block_size)
        bs = self.block_size
        for i in range(len(seq.hashes), num_full):
            prev = seq.hashes[-1] if seq.hashes else seq.salt
            h = chain_hash(prev, token_ids[i * bs:(i + 1) * bs])
            seq.hashes.append(h)
            block = seq.table[i]
            if self._block_hash[block] is None and h not in self._hash_to_block:
                self._block_hash[block] = h
                self._hash_to_block[h] = block
                if self._tier is not None:
                    self._registered.append((block, h))

    def _drop_out_of_window(self, seq: _SeqBlocks, num_computed: int) -> None:
        """Release leading blocks that no query from position ``num_computed`` on can see."""
        if self.sliding_window is None:
            return
        # a query at position p sees keys p - W + 1 .. p; block i ends at (i + 1) * bs - 1
        dead = max(0, (num_computed - self.sliding_window + 1) // self.block_size)
        dead = min(dead, len(seq.table))
        while seq.num_dropped < dead:
            self._release(seq.table[seq.num_dropped])
            seq.num_dropped += 1

    def _shared_write_blocks(self, seq: _SeqBlocks, num_computed: int, num_tokens: int) -> list[int]:
        """Indices into the table of shared blocks that tokens [num_computed, num_tokens) write."""
        first = num_computed // self.block_size
        last = min(len(seq.table), -(-num_tokens // self.block_size))
        return [i for i in range(first, last) if self._ref_counts[seq.table[i]] > 1]

    def _unshare_write_blocks(self, seq: _SeqBlocks, num_computed: int,
                              num_tokens: int) -> list[tuple[int, int]]:
        copies = []
        for i in self._shared_write_blocks(seq, num_computed, num_tokens):
            old, new = seq.table[i], self._take_fresh()
            self._ref_counts[old] -= 1  # still > 0: another table holds it
            seq.table[i] = new
            if i * self.block_size < num_computed:  # it holds computed tokens: copy them over
                copies.append((old, new))
        return copies

    def _take_fresh(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)  # evict the least recently used
            del self._hash_to_block[self._block_hash[block]]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] > 0:
            return
        if self._block_hash[block] is not None:
            self._cached[block] = None  # most recently used end
        else:
            self._free.append(block)
