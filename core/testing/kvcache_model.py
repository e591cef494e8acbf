"""Drive a KV backend the way the scheduler and the model runner do, and check it after every step.

Every token's K/V is a value derived from the token *prefix* ending at it (a
rolling hash), written through ``layer_view`` at the slot the block table
gives. So after any sequence of operations, for every live sequence, reading
its first ``stored`` slots back must give exactly those values: a block handed
out twice, a prefix-cache hit on the wrong block, or a copy-on-write that
did not copy all show up as a wrong value at a named position.
"""

from __future__ import annotations

import itertools

import torch

from lmplug.api import KVCacheBackend
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence
from lmplug.kit.kv_layout import kv_slots_list
from lmplug.testing.compare import ContractViolation

PROBE_TOKEN_BASE = 1_000_000  # token ids for capacity probes; never shared with test prompts
MAX_PROBES = 512  # the suite wants a small pool; configure the backend's options for one


class KVViolation(ContractViolation):
    """A KV backend broke its contract; the message says how and where."""


def prefix_values(tokens: list[int], modulus: int) -> list[float]:
    """One value per position, a function of the tokens up to and including it (never 0)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % modulus
        out.append(float(h + 1))
    return out


class KVModel:
    def __init__(self, kv: KVCacheBackend, label: str) -> None:
        self.kv = kv
        self.label = label
        self.bs = kv.block_size
        self.max_len = kv.spec.max_model_len
        layers = sorted({0, kv.spec.num_layers - 1})
        self.views = [kv.layer_view(i) for i in layers]
        # exact integers in the cache dtype: float32 holds 2**20 exactly, half types 2**8
        self.modulus = 1 << 20 if kv.spec.dtype == torch.float32 else 250
        self.live: dict[int, Sequence] = {}
        self.stored: dict[int, int] = {}  # seq_id -> leading tokens whose K/V were written
        self.histories: list[list[int]] = []  # token lists seen, to draw shared prefixes from
        self._probe_ids = itertools.count()

    # -- operations ------------------------------------------------------------------------------
    def new_sequence(self, tokens: list[int], request_id: str = "r") -> Sequence:
        seq = Sequence(request_id, tokens, SamplingParams(max_tokens=None, temperature=0))
        seq.start_running()
        return seq

    def add(self, tokens: list[int]) -> Sequence | None:
        """A new request: allocate its prompt (maybe a prefix hit), write what is not cached."""
        seq = self.new_sequence(tokens)
        n = seq.num_tokens
        if not self.kv.can_allocate(seq, n):
            return None
        cached = self.kv.allocate(seq, n)
        if not isinstance(cached, int) or not 0 <= cached < n:
            raise KVViolation(
                f"{self.label}: allocate(new sequence, {n}) returned {cached!r}; expected the "
                f"number of leading tokens already stored, an int in [0, {n - 1}] (a hit "
                f"never covers the last token, whose logits must be computed)"
            )
        if cached and "prefix_caching" not in self.kv.capabilities.features:
            raise KVViolation(
                f"{self.label}: allocate returned a prefix-cache hit of {cached} tokens, but "
                f"the backend does not claim 'prefix_caching' in capabilities.features"
            )
        self.live[seq.seq_id] = seq
        self.stored[seq.seq_id] = cached
        self.check_contents(seq, cached, when=f"after a prefix-cache hit of {cached} tokens")
        self._write(seq, cached, n)
        self.histories.append(list(tokens))
        return seq

    def grow(self, seq: Sequence, tokens: list[int]) -> bool:
        """Decode steps: append tokens and the storage for them; False (undone) if it does not fit."""
        seq.extend_tokens(tokens)
        n = seq.num_tokens
        if not self.kv.can_allocate(seq, n):
            seq.truncate_tokens(n - len(tokens))
            return False
        self.kv.allocate(seq, n)
        self._write(seq, self.stored[seq.seq_id], n)
        self.histories.append(list(seq.token_ids))
        return True

    def fork(self, parent: Sequence) -> Sequence:
        child = self.new_sequence(list(parent.token_ids), parent.request_id)
        child.fork_from(parent)
        self.kv.fork(parent, child)
        self.live[child.seq_id] = child
        self.stored[child.seq_id] = self.stored[parent.seq_id]
        self.check_contents(child, self.stored[child.seq_id], when="right after fork")
        return child

    def free(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.live.pop(seq.seq_id, None)
        self.stored.pop(seq.seq_id, None)

    def free_all(self) -> None:
        for seq in list(self.live.values()):
            self.free(seq)

    # -- writing as the runner does -------------------------------------------------------------------
    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        table = self.kv.block_table(seq)
        if len(table) * self.bs < end:
            raise KVViolation(
                f"{self.label}: sequence {seq.seq_id} was allocated {end} tokens but its "
                f"block_table {table} holds only {len(table) * self.bs} slots "
                f"(block_size {self.bs})"
            )
        num_blocks = self.views[0].k_cache.shape[0]
        bad = [b for b in table if not (isinstance(b, int) and 0 <= b < num_blocks)]
        if bad:
            raise KVViolation(
                f"{self.label}: block_table of sequence {seq.seq_id} has ids {bad} outside "
                f"[0, {num_blocks}) (the layer views' first dimension)"
            )
        return torch.tensor(kv_slots_list(table, range(start, end), self.bs))

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        self._check_exclusive(seq, start, end)
        slots = self.slots(seq, start, end)
        values = torch.tensor(prefix_values(seq.token_ids[:end], self.modulus)[start:end])
        for view in self.views:
            dev = view.k_cache.device
            shape = (len(values), *view.k_cache.shape[2:])
            rows = values.view(-1, 1, 1).expand(shape).to(view.k_cache.dtype)
            view.k_cache.view(-1, *shape[1:])[slots.to(dev)] = rows.to(dev)
            view.v_cache.view(-1, *shape[1:])[slots.to(dev)] = (-rows).to(dev)
        self.stored[seq.seq_id] = end
        seq.rewind(end)

    def _check_exclusive(self, seq: Sequence, start: int, end: int) -> None:
        """Blocks about to be written must belong to ``seq`` alone (no double allocation, CoW done)."""
        if start >= end:
            return
        table = self.kv.block_table(seq)
        mine = {table[p // self.bs] for p in range(start, min(end, len(table) * self.bs))}
        for other in self.live.values():
            if other.seq_id == seq.seq_id:
                continue
            shared = sorted(mine & set(self.kv.block_table(other)))
            if shared:
                raise KVViolation(
                    f"{self.label}: sequence {seq.seq_id} is about to write positions [{start}, {end}) "
                    f"into block(s) {shared}, which live sequence {other.seq_id} also holds "
                    f"(its table {self.kv.block_table(other)}); a block was handed out twice, or a "
                    f"shared block was not copied before being written"
                )

    # -- checks ------------------------------------------------------------------------------------
    def check_contents(self, seq: Sequence, upto: int | None = None, when: str = "") -> None:
        upto = self.stored[seq.seq_id] if upto is None else upto
        if upto == 0:
            return
        slots = self.slots(seq, 0, upto)
        expected = torch.tensor(prefix_values(seq.token_ids[:upto], self.modulus))
        for layer, view in enumerate(self.views):
            for name, cache, sign in (("K", view.k_cache, 1.0), ("V", view.v_cache, -1.0)):
                got = cache.view(-1, *cache.shape[2:])[slots.to(cache.device)].float().cpu()
                ok = (got == sign * expected.view(-1, 1, 1)).flatten(1).all(dim=1)
                if not ok.all():
                    p = int((~ok).nonzero()[0])
                    raise KVViolation(
                        f"{self.label}: {name} of sequence {seq.seq_id} at position {p} (slot "
                        f"{int(slots[p])}) reads back {float(got[p].flatten()[0]):g}, but "
                        f"{sign * float(expected[p]):g} was written for that token prefix"
                        f"{' ' + when if when else ''}; {int((~ok).sum())} of {upto} positions wrong "
                        f"(view {layer}). Its block table: {self.kv.block_table(seq)}"
                    )

    def check(self) -> None:
        usage = self.kv.usage
        if not 0.0 <= usage <= 1.0:
            raise KVViolation(f"{self.label}: usage is {usage}; it must be a fraction in [0, 1]")
        if not self.live and usage != 0.0:
            raise KVViolation(
                f"{self.label}: every sequence has been freed but usage is {usage:g} "
                f"(expected 0): blocks leaked"
            )
        for seq in self.live.values():
            self.check_contents(seq)

    def probe_capacity(self) -> int:
        """How many fresh one-block sequences fit (then freed again): a leak shrinks this number."""
        length = min(self.bs, self.max_len)
        held = {b for seq in self.live.values() for b in self.kv.block_table(seq)}
        probes = []
        while self.kv.can_allocate(probe := self._probe(length), length):
            if len(probes) == MAX_PROBES:
                raise KVViolation(
                    f"{self.label}: can_allocate still says yes after {MAX_PROBES} "
                    f"sequences of {length} tokens; give the backend a small pool in "
                    f"the test's `options` (the suite checks capacity by filling it)"
                )
            self.kv.allocate(probe, length)
            table = self.kv.block_table(probe)
            twice = sorted(held & set(table))
            if twice:
                raise KVViolation(
                    f"{self.label}: allocate gave a new sequence block(s) {twice} that "
                    f"another live sequence holds: a block was handed out twice"
                )
            held.update(table)
            probes.append(probe)
        for seq in probes:
            self.kv.free(seq)
        return len(probes)

    def _probe(self, length: int) -> Sequence:
        first = PROBE_TOKEN_BASE + next(self._probe_ids) * length
        return self.new_sequence(list(range(first, first + length)), request_id="probe")
