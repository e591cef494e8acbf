"""One attention step built from a ``BatchSpec``: inputs, a poisoned KV cache and the ``StepContext``.

The suite places each sequence's KV blocks itself, for the layout under test:
``contiguous`` gives every sequence one block (a row) longer than it needs,
rows in shuffled order; ``paged`` uses the spec's block size and a random
permutation of block ids. Every slot that holds no cached token is NaN, so a
backend that reads past a sequence's context, or through padding entries of
the block table, leaks NaN into its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmplug.api import KVLayerView, StepContext
from lmplug.kit.kv_layout import kv_slots_list
from lmplug.testing.batches import BatchSpec

POISON = float("nan")
NUM_SPARE_BLOCKS = 3


@dataclass
class AttentionCase:
    spec: BatchSpec
    layout: str
    q: torch.Tensor  # [T, H, D] the step's queries
    k: torch.Tensor  # [T, Hkv, D] the step's new keys
    v: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [S, Hkv, D]: its whole context (cached, then new)
    values: list[torch.Tensor]
    view: KVLayerView
    ctx: StepContext
    k_before: torch.Tensor  # the caches as handed to the backend
    v_before: torch.Tensor

    def locate(self, token: int) -> str:
        """'sequence i, query j (position p of S)' for a flattened token index."""
        start = 0
        for i, (qlen, seq_len) in enumerate(zip(self.spec.query_lens, self.spec.seq_lens)):
            if token < start + qlen:
                j = token - start
                kind = "decode" if i < self.spec.num_decodes else "prefill"
                return f"sequence {i} ({kind}), query {j} at position {seq_len - qlen + j} of {seq_len}"
            start += qlen
        return f"token {token}"

    def sequence_of(self, token: int) -> int:
        ends = torch.tensor(self.spec.query_lens).cumsum(0)
        return int((ends <= token).sum())


def build_case(
    spec: BatchSpec, layout: str, dtype: torch.dtype, device: str, seed: int = 0
) -> AttentionCase:
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    q = randn(sum(spec.query_lens), heads, dim)
    keys = [randn(s, kv_heads, dim) for s in spec.seq_lens]
    values = [randn(s, kv_heads, dim) for s in spec.seq_lens]
    block_size, tables, num_blocks, pad = place_blocks(spec, layout, gen)
    k_cache = torch.full(
        (num_blocks, block_size, kv_heads, dim), POISON, dtype=dtype, device=device
    )
    v_cache = torch.full_like(k_cache, POISON)
    new_slots, new_k, new_v = [], [], []
    for i, (ctx_len, seq_len) in enumerate(zip(spec.context_lens, spec.seq_lens)):
        slots = kv_slots_list(tables[i], range(seq_len), block_size)
        cached = torch.tensor(slots[:ctx_len], dtype=torch.int64, device=device)
        k_cache.view(-1, kv_heads, dim)[cached] = keys[i][:ctx_len]
        v_cache.view(-1, kv_heads, dim)[cached] = values[i][:ctx_len]
        new_slots += slots[ctx_len:]
        new_k.append(keys[i][ctx_len:])
        new_v.append(values[i][ctx_len:])
    ctx = step_context(spec, tables, pad, new_slots, device)
    view = KVLayerView(k_cache, v_cache, layout)
    return AttentionCase(
        spec,
        layout,
        q,
        torch.cat(new_k),
        torch.cat(new_v),
        keys,
        values,
        view,
        ctx,
        k_cache.clone(),
        v_cache.clone(),
    )


def place_blocks(
    spec: BatchSpec, layout: str, gen: torch.Generator
) -> tuple[int, list[list[int]], int, int]:
    """(block_size, block table per sequence, number of blocks, id of a poisoned padding block)."""
    if layout == "contiguous":
        # one row per sequence, longer than any context, so over-reads hit poison
        block_size = -(-(max(spec.seq_lens) + 1) // 16) * 16
        counts = [1] * len(spec.seq_lens)
    else:
        block_size = spec.block_size
        counts = [-(-s // block_size) for s in spec.seq_lens]
    num_blocks = sum(counts) + NUM_SPARE_BLOCKS
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in counts:
        tables.append(order[used : used + n])
        used += n
    return block_size, tables, num_blocks, order[used]


def step_context(
    spec: BatchSpec, tables: list[list[int]], pad: int, new_slots: list[int], device: str
) -> StepContext:
    width = max(len(t) for t in tables)
    positions = [p for c, s in zip(spec.context_lens, spec.seq_lens) for p in range(c, s)]
    query_lens = torch.tensor(spec.query_lens, dtype=torch.int32)
    cu = torch.zeros(len(spec.query_lens) + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=cu[1:])

    def on_device(values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    return StepContext(
        positions=on_device(positions, torch.int64),
        query_lens=query_lens.to(device),
        seq_lens=on_device(list(spec.seq_lens), torch.int32),
        cu_query_lens=cu.to(device),
        slot_mapping=on_device(new_slots, torch.int64),
        block_tables=on_device([t + [pad] * (width - len(t)) for t in tables], torch.int32),
        query_lens_cpu=list(spec.query_lens),
        seq_lens_cpu=list(spec.seq_lens),
        num_decodes=spec.num_decodes,
    )


def same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality in which NaN equals NaN (poisoned slots must stay poisoned)."""
    return (a == b) | (torch.isnan(a) & torch.isnan(b))
