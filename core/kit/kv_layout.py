"""Where a token's K/V lives: the slot address every KV layout and attention backend shares.

A layer's cache is ``[num_blocks, block_size, ...]``; flattened to ``[slots, ...]``, position
``p`` of a sequence whose blocks are ``block_table`` lives at slot

    block_table[p // block_size] * block_size + p % block_size

The contiguous layout is the case of one block of ``max_model_len`` slots per sequence (a ring
lists its row once per ring length). These helpers are that formula, written once, for
whoever needs slots: ``StepContext.slot_mapping``, the gathers of references and CPU paths.
The Triton kernels compute the same address in registers (``lmplug_attention.kv_ops``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def kv_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots (int64, shaped like ``positions``) of ``positions`` through ``block_table``.

    ``block_table`` is ``[..., max_blocks]`` (one sequence's table, or a batch of them);
    ``positions`` is either ``[..., N]`` with the table's leading dims (N positions per table)
    or ``[...]`` (one position per table, e.g. a table gathered per token). Every position
    must lie inside its table (``p // block_size < max_blocks``); callers that pad a batch
    clamp or mask the padding first.
    """
    if positions.dim() == block_table.dim() - 1:
        return kv_slots(block_table, positions.unsqueeze(-1), block_size).squeeze(-1)
    positions = positions.long()
    index = positions // block_size
    table = block_table.long()
    blocks = table[index] if table.dim() == 1 else table.gather(-1, index)
    return blocks * block_size + positions % block_size


def kv_slots_list(block_table: Sequence[int], positions: Iterable[int], block_size: int) -> list[int]:
    """``kv_slots`` on host lists, for code that builds its slots in Python."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
