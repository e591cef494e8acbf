"""Short queries read as decode rows: every query token becomes one decode row of its own.

A sequence with ``q`` new tokens after ``c`` cached ones (a speculative verify of ``k``
drafts: ``q = k + 1``; a small prefill chunk) is, for attention, ``q`` decode rows: token
``j`` attends to the first ``c + j + 1`` positions of the same block table, which is its
causal mask. The step writes every new token's K/V before attention runs, so those
positions are all in the cache.

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

from lmplug.interfaces import StepContext

MAX_QUERY_LEN = 32  # longer queries take the prefill path (its matmuls win there)


@dataclass
class QueryRows:
    num_seqs: int  # the step's first sequences read this way
    num_tokens: int  # their query tokens: rows [0, num_tokens) of q
    block_tables: torch.Tensor  # [num_tokens, max_blocks] int32, each row's sequence's table
    seq_lens: torch.Tensor  # [num_tokens] int32, the context each row attends to (itself included)
    seq_lens_cpu: list[int]


def leading_short_queries(ctx: StepContext, max_query_len: int = MAX_QUERY_LEN) -> int:
    """How many of the step's first sequences have at most ``max_query_len`` new tokens and no
    draft-tree mask (a tree row's context is not a prefix of the sequence)."""
    m = 0
    while m < ctx.num_seqs and ctx.query_lens_cpu[m] <= max_query_len and m not in ctx.tree_masks:
        m += 1
    return m


def query_rows(ctx: StepContext, num_seqs: int) -> QueryRows:
    """The decode rows of the step's first ``num_seqs`` sequences (see the module docstring)."""
    owners, lens = [], []
    for i in range(num_seqs):
        q, total = ctx.query_lens_cpu[i], ctx.seq_lens_cpu[i]
        owners.extend([i] * q)
        lens.extend(range(total - q + 1, total + 1))
    device = ctx.block_tables.device
    tables = ctx.block_tables[torch.tensor(owners, dtype=torch.long, device=device)]
    return QueryRows(num_seqs, len(lens), tables.to(torch.int32).contiguous(),
                     torch.tensor(lens, dtype=torch.int32, device=device), lens)
