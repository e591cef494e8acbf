"""``contiguous``: one preallocated row of ``max_model_len`` slots per running sequence.

The baseline the paged cache is measured against: simple and fast to read
(a sequence's K/V is one contiguous slice), but every sequence holds memory
for the longest possible context.
"""

from __future__ import annotations

import torch
from pydantic import Field

from lmplug.interfaces import BackendOptions, Capabilities, KVCacheBackend, KVCacheSpec, KVLayerView


class ContiguousOptions(BackendOptions):
    max_num_seqs: int | None = Field(default=None, ge=1,
                                     description="rows to preallocate (default: the scheduler's max_num_seqs)")


class ContiguousKVCache(KVCacheBackend):
    name = "contiguous"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}), kv_layouts=frozenset({"contiguous"}),
                                priority=10)
    Options = ContiguousOptions

    def __init__(self, options: ContiguousOptions, spec: KVCacheSpec) -> None:
        super().__init__(options, spec)
        self.num_rows = options.max_num_seqs or spec.max_num_seqs
        shape = (self.num_rows, spec.max_model_len, spec.num_kv_heads, spec.head_dim)
        # torch.empty: pages are only touched as sequences fill them
        self._k = [torch.empty(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]
        # the latent layout (MLA) stores no V: attention gets an empty view
        self._v = ([k[..., :0] for k in self._k] if spec.latent else
                   [torch.empty(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)])
        self._views = [KVLayerView(k, v, "contiguous") for k, v in zip(self._k, self._v)]
        self._free_rows = list(range(self.num_rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}

    @property
    def layout(self) -> str:
        return "contiguous"

    @property
    def block_size(self) -> int:
        return self.spec.max_model_len

    def layer_view(self, layer: int) -> KVLayerView:
        return self._views[layer]

    def can_allocate(self, seq, num_tokens: int) -> bool:
        if num_tokens > self.spec.max_model_len:
            return False
        return seq.seq_id in self._row_of or bool(self._free_rows)

    def allocate(self, seq, num_tokens: int) -> int:
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(f"contiguous KV cache: no room for sequence {seq.seq_id} "
                               f"({num_tokens} tokens; {len(self._free_rows)} free rows)")
        if seq.seq_id not in self._row_of:
            self._row_of[seq.seq_id] = self._free_rows.pop()
        return 0

    def free(self, seq) -> None:
        row = self._row_of.pop(seq.seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def block_table(self, seq) -> list[int]:
        return [self._row_of[seq.seq_id]]

    @property
    def usage(self) -> float:
        return len(self._row_of) / self.num_rows
