"""``KVCacheConformance``: accounting and storage of a KV backend under random operation sequences.

The operations are those of the engine (``kvcache_model.KVModel``): add a
request (its prompt may share a prefix with earlier ones), grow a sequence by
decoded tokens, fork it (``n > 1``), free it. After every operation: no block
is written by two live sequences, every stored token reads back what was
written, usage stays in [0, 1] and returns to 0 when everything is freed,
and the capacity after freeing everything equals the capacity at the start.
Fork and prefix-caching steps run only for backends that claim ``"fork"`` /
``"prefix_caching"`` in ``capabilities.features``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lmplug.api import KVCacheSpec
from lmplug.testing.base import ALL_DTYPES, Conformance
from lmplug.testing.compare import DTYPES, fail, reported
from lmplug.testing.kvcache_model import KVModel, KVViolation

TOKENS = st.integers(min_value=1, max_value=3)  # a tiny alphabet, so prompts share prefixes often


class KVCacheConformance(Conformance):
    family = "kvcache"
    # the model dimensions and limits the backend is built for; keep the pool small
    kv_spec: ClassVar[dict[str, Any]] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "max_model_len": 64,
        "max_num_seqs": 4,
    }
    kv_dtype: ClassVar[str | None] = (
        None  # default: float32 if claimed, else the first claimed dtype
    )
    max_examples: ClassVar[int] = 25  # hypothesis: random operation sequences per test
    steps_per_example: ClassVar[int] = 30

    # -- building --------------------------------------------------------------------------------
    @classmethod
    def spec(cls, backend_class: type) -> KVCacheSpec:
        dtype = cls.kv_dtype or next(
            d for d in ALL_DTYPES if d in backend_class.capabilities.dtypes
        )
        return KVCacheSpec(dtype=DTYPES[dtype], device=torch.device(cls.device), **cls.kv_spec)

    @pytest.fixture
    def make_model(self, backend_class, backend_options):
        def make() -> KVModel:
            try:
                kv = backend_class(backend_options, self.spec(backend_class))
            except Exception as exc:  # noqa: BLE001 - reported as the backend's failure
                fail(
                    f"{self.label()}: constructing it with {self.spec(backend_class)} raised "
                    f"{type(exc).__name__}: {exc}"
                )
            return KVModel(kv, self.label())

        return make

    def extra_declaration_problems(self, backend_class: type) -> list[str]:
        layouts = getattr(getattr(backend_class, "capabilities", None), "kv_layouts", frozenset())
        if len(layouts) != 1:
            return [
                f"capabilities.kv_layouts must name the one layout it provides; got {sorted(layouts)}"
            ]
        return []

    # -- tests -----------------------------------------------------------------------------------
    def test_layer_views(self, make_model) -> None:
        """Every layer's K and V: [num_blocks, block_size, Hkv, D], the spec's dtype, no aliasing."""
        model = make_model()
        kv, spec = model.kv, model.kv.spec
        if kv.layout not in kv.capabilities.kv_layouts:
            fail(
                f"{self.label()}: layout {kv.layout!r} is not in capabilities.kv_layouts "
                f"{sorted(kv.capabilities.kv_layouts)}"
            )
        tensors: list[tuple[str, torch.Tensor]] = []
        for layer in range(spec.num_layers):
            view = kv.layer_view(layer)
            for name, t in (("k_cache", view.k_cache), ("v_cache", view.v_cache)):
                where = f"{self.label()}: layer_view({layer}).{name}"
                if t.dim() != 4 or tuple(t.shape[1:]) != (
                    kv.block_size,
                    spec.num_kv_heads,
                    spec.head_dim,
                ):
                    fail(
                        f"{where} has shape {tuple(t.shape)}; expected [num_blocks, block_size="
                        f"{kv.block_size}, num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}]"
                    )
                if t.dtype != spec.dtype or t.device.type != spec.device.type:
                    fail(
                        f"{where} is {t.dtype} on {t.device}; the spec asks for {spec.dtype} on {spec.device}"
                    )
                if view.layout != kv.layout:
                    fail(
                        f"{where}: the view says layout {view.layout!r}, the backend {kv.layout!r}"
                    )
                tensors.append((where, t))
        # fill each with its own number: a tensor that overlaps another loses its number
        for i, (_, t) in enumerate(tensors):
            t.fill_(i + 1)
        for i, (where, t) in enumerate(tensors):
            if not bool((t == i + 1).all()):
                fail(
                    f"{where} overlaps another layer's cache, or its own K with V: writing one "
                    f"changed the other"
                )

    def test_fill_free_refill(self, make_model) -> None:
        """Allocate until full, free everything: usage back to 0 and the same capacity again."""
        model = make_model()
        with reported(self.label()):
            first = model.probe_capacity()
            if first == 0:
                raise KVViolation(
                    f"{self.label()}: can_allocate refuses even one sequence of {model.bs} tokens"
                )
            model.check()
            if None in (model.add([5, 6, 7]), model.add([7, 6, 5, 4])):
                raise KVViolation(
                    f"{self.label()}: can_allocate refused a 4-token sequence on an empty pool"
                )
            if not model.kv.usage > 0:
                raise KVViolation(
                    f"{self.label()}: usage is {model.kv.usage} with 2 sequences allocated "
                    f"(expected > 0)"
                )
            model.free_all()
            model.check()
            again = model.probe_capacity()
            if again != first:
                raise KVViolation(
                    f"{self.label()}: {first} one-block sequences fit at the start but "
                    f"{again} after allocating and freeing: blocks leaked"
                )

    def test_free_is_idempotent(self, make_model) -> None:
        """Freeing a sequence twice, or one never allocated, changes nothing."""
        model = make_model()
        with reported(self.label()):
            seq = model.add([1, 2, 3])
            model.kv.free(model.new_sequence([9, 9]))
            model.free(seq)
            model.kv.free(seq)
            model.check()

    def test_random_operations(self, make_model, backend_class) -> None:
        """Property-based: any sequence of add / grow / fork / free keeps every invariant."""
        features = self.exercised_features(backend_class.capabilities)
        machine = build_machine(make_model, "fork" in features)
        run_machine(machine, self.label(), self.max_examples, self.steps_per_example)

    def test_fork_shares_then_copies(self, make_model, backend_class) -> None:
        self.require_features(backend_class, "fork")
        model = make_model()
        with reported(self.label()):
            parent = model.add([1, 2] * model.bs + [3])
            child = model.fork(parent)
            for seq, token in ((parent, 7), (child, 8), (child, 9)):
                if not model.grow(seq, [token]):
                    raise KVViolation(
                        f"{self.label()}: no room to grow a forked sequence by one token"
                    )
                model.check()
            model.free(parent)
            model.check()
            model.free_all()
            model.check()

    def test_prefix_cache_hit(self, make_model, backend_class) -> None:
        self.require_features(backend_class, "prefix_caching")
        model = make_model()
        prompt = [(i * 7) % 5 + 1 for i in range(3 * model.bs + 2)]
        with reported(self.label()):
            model.add(prompt)
            for when in ("while the first is live", "after the first was freed"):
                seq = model.add(prompt[:-1] + [9, 9])
                if model.stored[seq.seq_id] == 0:
                    raise KVViolation(
                        f"{self.label()}: a request sharing {len(prompt) - 1} prompt tokens ({when}) got "
                        f"no prefix-cache hit (allocate returned 0) although the backend claims prefix_caching"
                    )
                model.check()
                model.free(seq)
            model.free_all()
            model.check()


def build_machine(make_model, can_fork: bool) -> type[RuleBasedStateMachine]:
    class KVCacheOperations(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()
            self.capacity = self.model.probe_capacity()

        def _pick(self, data):
            return data.draw(
                st.sampled_from(sorted(self.model.live.values(), key=lambda s: s.seq_id)),
                label="sequence",
            )

        @rule(data=st.data())
        def add_request(self, data) -> None:
            m = self.model
            prefix: list[int] = []
            if m.histories and data.draw(st.booleans(), label="share a prefix"):
                base = data.draw(st.sampled_from(m.histories), label="earlier tokens")
                prefix = base[: data.draw(st.integers(0, len(base)), label="prefix length")]
            room = max(1, m.max_len // 2 - len(prefix))
            extra = data.draw(
                st.lists(TOKENS, min_size=1, max_size=min(room, 2 * m.bs + 1)), label="new"
            )
            m.add((prefix + extra)[: m.max_len - 1])

        @precondition(lambda self: self.model.live)
        @rule(data=st.data())
        def grow(self, data) -> None:
            seq = self._pick(data)
            room = self.model.max_len - seq.num_tokens
            if room > 0:
                n = data.draw(st.integers(1, min(room, self.model.bs + 2)), label="new tokens")
                self.model.grow(
                    seq, data.draw(st.lists(TOKENS, min_size=n, max_size=n), label="tokens")
                )

        @precondition(lambda self: can_fork and self.model.live)
        @rule(data=st.data())
        def fork(self, data) -> None:
            self.model.fork(self._pick(data))

        @precondition(lambda self: self.model.live)
        @rule(data=st.data())
        def free(self, data) -> None:
            self.model.free(self._pick(data))

        @rule()
        def free_everything(self) -> None:
            self.model.free_all()
            self.model.check()
            again = self.model.probe_capacity()
            if again != self.capacity:
                raise KVViolation(
                    f"{self.model.label}: {self.capacity} one-block sequences fit at the "
                    f"start but {again} after freeing everything: blocks leaked"
                )

        @invariant()
        def consistent(self) -> None:
            self.model.check()

    return KVCacheOperations


def run_machine(
    machine: type[RuleBasedStateMachine], label: str, max_examples: int, steps: int
) -> None:
    config = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    try:
        run_state_machine_as_test(machine, settings=config)
        return
    except Exception as exc:  # noqa: BLE001 - hypothesis re-raises the backend's own error
        what = str(exc) if isinstance(exc, KVViolation) else f"{label}: {type(exc).__name__}: {exc}"
        notes = "\n".join(getattr(exc, "__notes__", []))
    fail(f"{what}\n\nThe shortest sequence of operations hypothesis found that fails:\n{notes}")
