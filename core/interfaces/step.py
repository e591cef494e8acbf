"""The per-step record every attention backend reads (built once per step by the runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepContext:
    """Where the step's flattened tokens sit and what each sequence attends to.

    Sequences are ordered decodes first (``query_len == 1`` and some context
    cached), so kernels can take a fast path over ``[:num_decodes]``; then the
    other sequences without a draft tree, shortest query first; then draft trees.

    Shapes: T = tokens in this step, B = sequences in this step.
    """

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    query_lens: torch.Tensor  # [B] int32, new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    cu_query_lens: torch.Tensor  # [B+1] int32, prefix sums of query_lens
    slot_mapping: torch.Tensor  # [T] int64, cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [B, max_blocks] int32, cache blocks of each sequence
    query_lens_cpu: list[int]  # host copies, for decisions made in Python
    seq_lens_cpu: list[int]
    num_decodes: int
    # tree speculative decoding: batch index -> bool [n+1, n+1] ancestor-or-self mask over that
    # sequence's new tokens (the root, its last accepted token, first). Its new tokens then sit at
    # positions start + depth (``positions``) but their K/V at slots start + j; attention lets new
    # token a see new token b only where mask[a, b] (plus the whole cached context, and the
    # sliding window by position). Empty when no tree is in the step; backends that do not list
    # the "tree_attention" feature never see one (refused at load time)
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # what a backend derives from the fields above once per step and reuses in every layer
    # (e.g. a gather index), keyed by the backend; the runner starts each step with it empty
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs
