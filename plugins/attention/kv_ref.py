"""The KV-cache operations in PyTorch: the reference of ``kv_ops`` (write, dequantizing read).

- ``reshape_and_cache``: write the step's K/V into the cache slots of ``slot_mapping``
  (slot ``s`` = block ``s // block_size``, offset ``s % block_size``; a negative slot is
  padding and skipped), quantizing them (``store_kv``) when the cache has scales.
- ``gather_context``: the first ``num_tokens`` positions of each sequence, read through its
  block table (``lmplug.kit.kv_layout``), dequantized to the reader's dtype
  (``dequantize_kv``: the op order the kernels' ``dequant_kv_tile`` follows).

The attention references (``decode_ref``, ``prefill_ref``) and the PyTorch paths that read
the cache (``sdpa``, ``paged_torch``, ``mla_ref``) gather through ``gather_context``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmplug.kit.kv_quant import dequantize_kv, store_kv


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] -> cache rows ``slot_mapping`` [T] of k_cache, v_cache [N, block_size, Hkv, D]
    (quantized, with scales into k_scale, v_scale [N, block_size, Hkv], when those are given)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slot_mapping = slot_mapping.long()
    store_kv(k_cache, k_scale, k, slot_mapping)
    store_kv(v_cache, v_scale, v, slot_mapping)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                   scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first ``num_tokens`` slots of each table's blocks: [B, blocks] -> [B, num_tokens, Hkv, D]
    (dequantized to ``dtype``, default float32, with ``scale`` [N, block_size, Hkv] when the
    cache is quantized). A sequence shorter than ``num_tokens`` gets whatever its table's
    further entries point at: callers mask (and zero) those positions."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    tables = block_tables[:, :num_blocks].long()

    def gather(t: torch.Tensor) -> torch.Tensor:
        # one gather of whole blocks for the whole batch (the slots of kv_layout.kv_slots, a block
        # at a time); embedding's row gather is several times faster on CPU than index_select
        rows = F.embedding(tables.reshape(-1), t.reshape(t.shape[0], -1))
        return rows.view(tables.shape[0], num_blocks * block_size, *t.shape[2:])  # [B, nb * bs, ...]

    blocks = gather(cache)
    if scale is not None:  # whole blocks, then the slice: the layout an unquantized cache gives
        blocks = dequantize_kv(blocks, gather(scale), dtype or torch.float32)
    return blocks[:, :num_tokens]
