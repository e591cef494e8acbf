"""Random paged KV caches and the float64 attention over them (a helper module, not a test file),
shared by the native decode kernel's tests (test_paged_native.py, test_paged_native_tree.py)."""

from __future__ import annotations

import torch


def paged_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, poison=False):
    """Random caches with each sequence's blocks scattered over a pool with spare blocks, tables
    padded past each sequence's last block. ``poison``: NaN in every slot no sequence uses
    (the tails of last blocks, the spare blocks the table padding points at)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    pool = sum(blocks) + 3
    shape = (pool, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    order = torch.randperm(pool, generator=g)
    tables = torch.zeros(len(lens), max(blocks) + 2, dtype=torch.int32)
    used = torch.zeros(pool, block_size, dtype=torch.bool)
    start = 0
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        tables[i, :nb] = order[start:start + nb]
        tables[i, nb:] = order[-1 - i % 3]  # padding: a spare block
        for p in range(n):
            used[tables[i, p // block_size], p % block_size] = True
        start += nb
    if poison:
        k_cache[~used] = float("nan")
        v_cache[~used] = float("nan")
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def float64_attention(q, k_cache, v_cache, tables, lens, scale, window=None):
    """The math, sequence by sequence over exactly the slots each one attends to, in float64."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window else 0
        slots = [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(first, n)]
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()  # [S, Hkv, D]
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
        qi = q[i].double().view(num_kv_heads, group, head_dim)
        w = torch.softmax(torch.einsum("hgd,shd->hgs", qi, k) * scale, -1)
        out[i] = torch.einsum("hgs,shd->hgd", w, v).reshape(num_heads, head_dim)
    return out
