"""``flash`` decode: one new token per sequence over its cache, split-K over a chosen partition count.

The kernel (GQA tiles, in-register dequantization, split-K with a reduce) is
``decode_ops``, shared with ``paged``; this entry point takes the split as a
count (``num_splits``, the ``flash`` option) and plans it from the context
length and the batch when not given. The PyTorch reference is
``decode_ref.decode_attention``.
"""

from __future__ import annotations

import torch
from lmplug_attention.attn_ops import check_power_of_two, output_for, window_arg
from lmplug_attention.decode_ops import (
    MAX_SPLITS,
    check_decode,
    decode_block_n,
    launch_decode,
    num_sms,
    plan_decode,
)


def flash_decode_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                              sliding_window: int | None = None, max_seq_len: int | None = None,
                              num_splits: int | None = None, out: torch.Tensor | None = None,
                              block_n: int | None = None, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None, softcap: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its cache: q [B, H, D] -> [B, H, D].

    k_cache, v_cache: [num_blocks, block_size, Hkv, D] holding each sequence's
    ``seq_lens[b]`` (int32 [B], each >= 1) keys at the blocks listed in
    ``block_tables[b]`` (int32 [B, max_blocks]). ``num_splits`` forces the
    number of split-K partitions (``None``: chosen from context length and
    batch size; 1: no split); ``max_seq_len`` (a host int) spares a sync. ``k_scale`` /
    ``v_scale`` ([num_blocks, block_size, Hkv] float32) mark int8 / float8_e4m3fn caches.
    ``softcap``: scores soft-capped, ``softcap * tanh(s / softcap)``; ``sinks`` [H]: one logit per
    query head joined to the softmax denominator (attention sinks).
    """
    what = "flash_decode_with_kvcache"
    check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, what)
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{what}: num_splits must be None or in [1, {MAX_SPLITS}], got {num_splits}")
    window = window_arg(sliding_window, what)
    out = output_for(q, out, what)
    if q.shape[0] == 0:
        return out
    bn = block_n or decode_block_n(q.shape[2])
    check_power_of_two(bn, "block_n", what)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    splits, partition = plan_decode(q.shape[0], k_cache.shape[2], max_seq_len, sliding_window, bn, num_splits,
                                    num_sms(q.device))
    return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, splits, partition, bn,
                         out, k_scale, v_scale, softcap, sinks)
