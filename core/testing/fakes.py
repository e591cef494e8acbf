"""Stand-ins the suite drives backends with: an accounting-only paged KV cache for schedulers.

``FakePagedKV`` counts blocks like a paged backend and holds tiny tensors
(``[num_blocks, block_size, 1, 2]``, NaN until written) so the scheduler
harness can record which token each slot holds. It refuses, with a message
naming the scheduler's mistake, an ``allocate`` that ``can_allocate`` would
have refused.
"""

from __future__ import annotations

import torch

from lmplug.api import BackendOptions, Capabilities, KVCacheBackend, KVCacheSpec, KVLayerView
from lmplug.testing.compare import ContractViolation


class SchedulerViolation(ContractViolation):
    """A scheduler broke its contract; the message says how, at which step."""


def fake_spec(max_model_len: int, max_num_seqs: int) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
    )


class FakePagedKV(KVCacheBackend):
    name = "lmplug-testing-fake-paged"
    capabilities = Capabilities(kv_layouts=frozenset({"paged"}))

    def __init__(
        self, options: BackendOptions, spec: KVCacheSpec, *, num_blocks: int, block_size: int = 4
    ) -> None:
        super().__init__(options, spec)
        self._block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        k = torch.full((num_blocks, block_size, spec.num_kv_heads, spec.head_dim), float("nan"))
        self._view = KVLayerView(k, torch.full_like(k, float("nan")), "paged")

    @property
    def layout(self) -> str:
        return "paged"

    @property
    def block_size(self) -> int:
        return self._block_size

    def layer_view(self, layer: int) -> KVLayerView:
        return self._view

    def _missing(self, seq, num_tokens: int) -> int:
        need = -(-num_tokens // self._block_size)
        return need - len(self._tables.get(seq.seq_id, []))

    def can_allocate(self, seq, num_tokens: int) -> bool:
        return num_tokens <= self.spec.max_model_len and self._missing(seq, num_tokens) <= len(
            self._free
        )

    def allocate(self, seq, num_tokens: int) -> int:
        if not self.can_allocate(seq, num_tokens):
            raise SchedulerViolation(
                f"allocate({seq!r}, {num_tokens}) although can_allocate said no: it needs "
                f"{self._missing(seq, num_tokens)} more blocks of {self._block_size} and "
                f"{len(self._free)} of {self.num_blocks} are free (max_model_len {self.spec.max_model_len})"
            )
        table = self._tables.setdefault(seq.seq_id, [])
        for _ in range(max(0, self._missing(seq, num_tokens))):
            block = self._free.pop()
            self._view.k_cache[block] = float("nan")  # a reused block holds nothing valid
            table.append(block)
        return 0

    def free(self, seq) -> None:
        self._free.extend(reversed(self._tables.pop(seq.seq_id, [])))

    def block_table(self, seq) -> list[int]:
        return list(self._tables.get(seq.seq_id, []))

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks
