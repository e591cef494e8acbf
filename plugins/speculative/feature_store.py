"""``FeatureStore``: the target's final hidden state at every position it computed, kept by KV slot.

EAGLE drafts from the target's feature at *every* position of a sequence (its prompt too),
not only at the last one. A forward hook on the target model copies each step's output
``hidden [T, h]`` to ``features[ctx.slot_mapping]``, the slots where the same step wrote
the tokens' K/V. So a feature lives exactly as long as its K/V: shared prefix-cache
blocks hold features that whichever sequence computed them left there (equal tokens at
equal positions give equal features), truncated drafts are overwritten later, and a
position is read back through the sequence's block table like its K/V.

Memory: ``h`` values per KV slot of the target (one layer's K+V is ``2 Hkv D``; for the
demo model h = 576 against 30 x 384 per slot, about 5% on top of the KV cache).

Caveat: when a block is copied on write (a forked sequence writing into a shared block),
the copy gets the K/V but not the features; the drafter reads a sequence's features as
soon as they are computed (before the next step allocates), which is before such a copy.
"""

from __future__ import annotations

import torch

from lmplug.api import KVCacheBackend, StepContext
from lmplug.kit.kv_layout import kv_slots


class FeatureStore:
    def __init__(self, model: torch.nn.Module, kv: KVCacheBackend, hidden_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        view = kv.layer_view(0)
        num_slots = view.k_cache.shape[0] * view.k_cache.shape[1]
        self.kv = kv
        self.features = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)
        self._handle = model.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        ctx = next((a for a in args if isinstance(a, StepContext)), None)
        if ctx is None or not isinstance(output, torch.Tensor) or output.shape[0] != ctx.slot_mapping.shape[0]:
            return
        self.features.index_copy_(0, ctx.slot_mapping, output.detach().to(self.features.dtype))

    def read(self, seq, start: int, end: int) -> torch.Tensor:
        """Features of ``seq`` at positions [start, end): [end - start, h]."""
        return self.features[self._slots(seq, torch.arange(start, end))]

    def move(self, seq, src: list[int], dst: list[int]) -> None:
        """The features at positions ``src`` of ``seq`` to positions ``dst``, as the engine moved
        their K/V after verifying a draft tree (gathered first, so overlaps are safe)."""
        if src:
            self.features[self._slots(seq, torch.tensor(dst))] = self.features[self._slots(seq, torch.tensor(src))]

    def _slots(self, seq, pos: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(self.kv.block_table(seq), dtype=torch.long)
        return kv_slots(table, pos, self.kv.block_size).to(self.features.device)

    def close(self) -> None:
        self._handle.remove()
