"""``StateCacheConformance``: the per-sequence state slots of a KV backend with the ``"state"`` feature.

A hybrid model's spec (``KVCacheSpec.states``: a conv state in the model dtype and recurrent
states in fp32, beside two softmax layers' K/V) is handed to the backend, which must then:

- give every state layer's tensors as pools ``[num_slots, *shape]`` of the declared dtype, no two
  aliasing, with at least ``max_num_seqs`` slots;
- give each live sequence its own slot from its first ``allocate`` to ``free``, the same in every
  layer, holding the zero state when taken (a fresh or preempted-and-recomputed sequence);
- keep what a sequence wrote in its slot while others come and go (random operations);
- refuse (``can_allocate`` False) a new sequence when every slot is held, and take it again once
  one is freed: the scheduler's admission sees the states;
- on ``fork`` (backends claiming ``"fork"``): give the child its own slot holding a copy of the
  parent's state.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import torch

from lmplug.api import KVCacheSpec, SamplingParams, Sequence
from lmplug.interfaces.state import StateSpec, StateTensor
from lmplug.testing.base import Conformance
from lmplug.testing.compare import fail


class StateCacheConformance(Conformance):
    family = "kvcache"
    max_num_seqs: ClassVar[int] = 4
    random_steps: ClassVar[int] = 300  # random operations in test_random_operations

    @classmethod
    def spec(cls) -> KVCacheSpec:
        states = (StateSpec(0, "mamba2", (StateTensor("conv", (6, 3), torch.float32),
                                          StateTensor("ssm", (2, 4, 3), torch.float32))),
                  StateSpec(2, "linear_attention", (StateTensor("state", (2, 3, 5), torch.float32),)))
        return KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                           device=torch.device(cls.device), max_model_len=64, max_num_seqs=cls.max_num_seqs,
                           states=states)

    def _build(self, backend_class, backend_options) -> Any:
        if "state" not in backend_class.capabilities.features:
            fail(f"{self.label()}: StateCacheConformance needs a backend claiming the 'state' feature; "
                 f"it claims {sorted(backend_class.capabilities.features)}")
        try:
            return backend_class(backend_options, self.spec())
        except Exception as exc:  # noqa: BLE001 - reported as the backend's failure
            fail(f"{self.label()}: constructing it with state layers raised {type(exc).__name__}: {exc}")

    def _seq(self, tokens: int = 3) -> Sequence:
        seq = Sequence("r", [1] * tokens, SamplingParams(max_tokens=None, temperature=0))
        seq.start_running()
        return seq

    def _allocate(self, kv, seq: Sequence) -> None:
        if not kv.can_allocate(seq, seq.num_tokens):
            fail(f"{self.label()}: can_allocate refused sequence {seq.seq_id} with slots free")
        kv.allocate(seq, seq.num_tokens)

    # -- tests -------------------------------------------------------------------------------------
    def test_state_views(self, backend_class, backend_options) -> None:
        kv = self._build(backend_class, backend_options)
        seen: list[tuple[str, torch.Tensor]] = []
        for i, spec in enumerate(kv.spec.states):
            pools = kv.state_view(i)
            for t in spec.tensors:
                where = f"{self.label()}: state_view({i})[{t.name!r}]"
                pool = pools.get(t.name)
                if pool is None:
                    fail(f"{where} is missing; the view has {sorted(pools)}")
                if tuple(pool.shape[1:]) != t.shape or pool.dtype != t.dtype:
                    fail(f"{where} is {pool.dtype} {tuple(pool.shape)}; expected {t.dtype} [num_slots, *{t.shape}]")
                if pool.shape[0] < self.max_num_seqs:
                    fail(f"{where} has {pool.shape[0]} slots, fewer than max_num_seqs={self.max_num_seqs}")
                seen.append((where, pool))
        for n, (_, pool) in enumerate(seen):
            pool.fill_(n + 1)
        for n, (where, pool) in enumerate(seen):
            if not bool((pool == n + 1).all()):
                fail(f"{where} overlaps another state tensor: writing one changed the other")

    def test_random_operations(self, backend_class, backend_options) -> None:
        """Allocate / write / free at random: each live sequence keeps its own slot and values;
        a new sequence starts from zeros."""
        kv = self._build(backend_class, backend_options)
        rng = random.Random(0)
        live: dict[int, tuple[Sequence, float]] = {}
        for step in range(self.random_steps):
            if live and (len(live) == self.max_num_seqs or rng.random() < 0.4):
                seq, _ = live.pop(rng.choice(sorted(live)))
                kv.free(seq)
            else:
                seq = self._seq(rng.randint(1, 8))
                self._allocate(kv, seq)
                self._check_slot(kv, seq, 0.0, f"a new sequence (step {step})")
                value = float(step + 1)
                self._write(kv, seq, value)
                live[seq.seq_id] = (seq, value)
            slots = [kv.state_slot(s) for s, _ in live.values()]
            if len(set(slots)) != len(slots):
                fail(f"{self.label()}: live sequences share a state slot: {slots}")
            for seq, value in live.values():
                self._check_slot(kv, seq, value, f"a live sequence (step {step})")

    def test_admission_counts_state_slots(self, backend_class, backend_options) -> None:
        kv = self._build(backend_class, backend_options)
        held = [self._seq() for _ in range(self.max_num_seqs)]
        for seq in held:
            self._allocate(kv, seq)
        extra = self._seq()
        if kv.can_allocate(extra, extra.num_tokens):
            fail(f"{self.label()}: can_allocate accepted sequence {self.max_num_seqs + 1} with every "
                 f"state slot held (max_num_seqs={self.max_num_seqs}); the scheduler would admit a "
                 "sequence with nowhere to keep its state")
        kv.free(held[0])
        self._allocate(kv, extra)
        self._check_slot(kv, extra, 0.0, "a sequence admitted into a freed slot")

    def test_fork_copies_the_state(self, backend_class, backend_options) -> None:
        self.require_features(backend_class, "fork")
        kv = self._build(backend_class, backend_options)
        parent, child = self._seq(5), self._seq(5)
        self._allocate(kv, parent)
        self._write(kv, parent, 7.0)
        child.fork_from(parent)
        kv.fork(parent, child)
        if kv.state_slot(child) == kv.state_slot(parent):
            fail(f"{self.label()}: fork gave the child the parent's state slot")
        self._check_slot(kv, child, 7.0, "a forked child")
        self._write(kv, child, 9.0)
        self._check_slot(kv, parent, 7.0, "the parent after its child wrote")

    # -- helpers ------------------------------------------------------------------------------------
    def _write(self, kv, seq: Sequence, value: float) -> None:
        slot = kv.state_slot(seq)
        for i in range(len(kv.spec.states)):
            for pool in kv.state_view(i).values():
                pool[slot] = value

    def _check_slot(self, kv, seq: Sequence, value: float, what: str) -> None:
        slot = kv.state_slot(seq)
        for i in range(len(kv.spec.states)):
            for name, pool in kv.state_view(i).items():
                if not bool((pool[slot] == value).all()):
                    fail(f"{self.label()}: {what} (sequence {seq.seq_id}, slot {slot}) reads "
                         f"{pool[slot].flatten()[:4].tolist()}... in state layer {i} {name!r}; expected "
                         f"{value} everywhere")
