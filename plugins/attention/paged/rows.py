"""Short queries read as decode rows: every query token becomes one decode row of its own.

A sequence with ``q`` new tokens after ``c`` cached ones (a speculative verify of ``k``
drafts: ``q = k + 1``; a small prefill chunk) is, for attention, ``q`` decode rows: token
``j`` attends to the first ``c + j + 1`` positions of the same block table, which is its
causal mask. The step writes every new token's K/V before attention runs, so those
positions are all in the cache.

A draft tree (``ctx.query_masks``, tree speculative decoding) is read the same way when the
kernel takes row masks (the native one): query token ``j`` (0 = the root) is a row over the
first ``c + j + 1`` positions whose last ``j + 1`` are masked to its ancestors and itself
(``mask_starts = c``, ``masks`` bit ``a`` for query token ``a``). The kernel attends to the
listed positions in order, so a node gets bit for bit what the same token gets decoded
alone once the accepted path's K/V has moved to consecutive positions.

Why: on CPU the decode kernels (``paged_native``, ``paged_cpu``) are faster than the
varlen prefill path for a few tokens, and with the native kernel a row's result depends on
nothing but its own context: the same token gets bit for bit the same attention output
whether it is decoded alone or verified with drafts, so speculative decoding in bfloat16 keeps plain
decoding's greedy output (the linear layers are batch invariant at these sizes, see
``benchmarks/bench_speculative.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmplug.api import StepContext

MAX_QUERY_LEN = 32  # longer queries take the prefill path (its matmuls win there)
MAX_TREE_LEN = 64  # a tree row's mask spans its query tokens: 64 bits


@dataclass
class QueryRows:
    num_seqs: int  # the step's first sequences read this way
    num_tokens: int  # their query tokens: rows [0, num_tokens) of q
    block_tables: torch.Tensor  # [num_tokens, max_blocks] int32, each row's sequence's table
    seq_lens: torch.Tensor  # [num_tokens] int32, the context each row attends to (itself included)
    seq_lens_cpu: list[int]
    # draft trees among them: per row the first masked position (-1: none) and the mask bits
    mask_starts: torch.Tensor | None = None  # [num_tokens] int32
    masks: torch.Tensor | None = None  # [num_tokens] int64 (the uint64 bits)


def leading_short_queries(ctx: StepContext, max_query_len: int = MAX_QUERY_LEN, trees: bool = False) -> int:
    """How many of the step's first sequences have at most ``max_query_len`` new tokens (draft
    trees: at most ``MAX_TREE_LEN``, and only with ``trees``, a kernel that takes row masks). A
    row reads the keys up to its own, so a mask that lets a token see a later one (a diffusion
    canvas, bidirectional) ends the run: the prefill path reads it."""
    m = 0
    while m < ctx.num_seqs:
        if m in ctx.query_masks:
            mask = ctx.query_masks[m]
            readable = trees and (mask is None or not bool(torch.triu(mask, 1).any()))
            limit = MAX_TREE_LEN if readable else -1
        else:
            limit = max_query_len
        if ctx.query_lens_cpu[m] > limit:
            break
        m += 1
    return m


def query_rows(ctx: StepContext, num_seqs: int) -> QueryRows:
    """The decode rows of the step's first ``num_seqs`` sequences (see the module docstring)."""
    owners, lens, starts, bits = [], [], [], []
    trees = any(i in ctx.query_masks for i in range(num_seqs))
    for i in range(num_seqs):
        q, total = ctx.query_lens_cpu[i], ctx.seq_lens_cpu[i]
        owners.extend([i] * q)
        lens.extend(range(total - q + 1, total + 1))
        if i in ctx.query_masks:
            starts.extend([total - q] * q)
            bits.append(_bits(ctx.query_masks[i]))
        elif trees:
            starts.extend([-1] * q)
            bits.append(torch.zeros(q, dtype=torch.int64))
    device = ctx.block_tables.device
    tables = ctx.block_tables[torch.tensor(owners, dtype=torch.long, device=device)]
    rows = QueryRows(num_seqs, len(lens), tables.to(torch.int32).contiguous(),
                     torch.tensor(lens, dtype=torch.int32, device=device), lens)
    if trees:
        rows.mask_starts = torch.tensor(starts, dtype=torch.int32, device=device)
        rows.masks = torch.cat(bits).to(device)
    return rows


def _bits(mask: torch.Tensor) -> torch.Tensor:
    """Ancestor-mask rows [q, q] as uint64 bits in int64 [q] (bit a: query token a; bit 63 is
    the sign bit, so at most one negative term and no overflow in the sum)."""
    return (mask.to(device="cpu", dtype=torch.int64) * _BIT[:mask.shape[1]]).sum(1)


_BIT = torch.tensor([1 << a for a in range(63)] + [-(1 << 63)], dtype=torch.int64)
