"""``paged`` kernels in Triton: the decode entry point, with the split-K partition in tokens.

The cache of one layer is ``[num_blocks, block_size, Hkv, D]`` (K and V alike);
a sequence's tokens live in the blocks its block table lists, in any order.
The operations, each shared with ``flash`` and each with a PyTorch reference:

- the write: ``kv_ops.reshape_and_cache`` (reference ``kv_ref.reshape_and_cache``);
- ``paged_decode_attention`` (here): the ``decode_ops`` kernel (GQA tiles,
  in-register dequantization of quantized KV, split-K with a reduce), its split
  given as a partition size in tokens, the ``paged`` option (reference
  ``decode_ref.decode_attention``);
- ``paged_prefill_kernels.paged_prefill_attention``: varlen queries over a
  cached prefix plus the new tokens (reference ``prefill_ref.prefill_attention``).
"""

from __future__ import annotations

import torch
from lmplug_attention.attn_ops import output_for, window_arg
from lmplug_attention.decode_ops import (
    check_decode,
    decode_block_n,
    decode_span,
    launch_decode,
    num_sms,
    plan_decode,
)


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                          sliding_window: int | None = None, head_dim: int = 128) -> int | None:
    """The partition the automatic plan (``decode_ops.plan_decode``) splits into; None: no split."""
    splits, partition = plan_decode(num_seqs, num_kv_heads, max_seq_len, sliding_window,
                                    decode_block_n(head_dim), None, num_sms(device))
    return partition if splits > 1 else None


def _plan(partition_size: int | None, batch: int, num_kv_heads: int, max_seq_len: int,
          sliding_window: int | None, block_n: int, device: torch.device) -> tuple[int, int, int]:
    """(splits, partition, block_n) for ``partition_size``: None plans, 0 never splits, else forced."""
    if not partition_size:
        splits, partition = plan_decode(batch, num_kv_heads, max_seq_len, sliding_window, block_n,
                                        1 if partition_size == 0 else None, num_sms(device))
        return splits, partition, block_n
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"paged_decode_attention: partition_size must be 0, None or a power of two >= 16, "
                         f"got {partition_size}")
    block_n = min(block_n, partition_size)  # both powers of two: the partition is whole tiles
    span = decode_span(max_seq_len, sliding_window, block_n)
    return -(-span // partition_size), partition_size, block_n


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None, max_seq_len: int | None = None,
                           partition_size: int | None = None, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], block_tables [B, max_blocks] int32, seq_lens [B] int32 (each >= 1) -> [B, H, D].

    ``partition_size`` forces split-K with partitions of that many tokens (a
    power of two >= 16), 0 forbids it, ``None`` decides from the batch and
    context size. ``max_seq_len`` (host int) spares a device sync. ``out``
    ([B, H, D], q's dtype) receives the result when given. ``k_scale`` / ``v_scale``
    ([num_blocks, block_size, Hkv] float32) mark int8 / float8_e4m3fn caches. ``softcap``: scores
    soft-capped, ``softcap * tanh(s / softcap)``; ``sinks`` [H]: one logit per query head joined to
    the softmax denominator (attention sinks).
    """
    what = "paged_decode_attention"
    check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, what)
    window = window_arg(sliding_window, what)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if q.shape[0] else 0
    splits, partition, block_n = _plan(partition_size, q.shape[0], k_cache.shape[2], max_seq_len,
                                       sliding_window, decode_block_n(q.shape[2]), q.device)
    out = output_for(q, out, what)
    if q.shape[0] == 0:
        return out
    return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, splits, partition,
                         block_n, out, k_scale, v_scale, softcap, sinks)
