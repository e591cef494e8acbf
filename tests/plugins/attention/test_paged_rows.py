"""On CPU, `paged` reads short queries (speculative verifies, small chunks) as decode rows.

The property that matters: with the native kernel a token verified together with other
drafts gets bit for bit the attention output it gets when decoded alone, step by step,
whatever else shares the batch. That is what keeps speculative decoding's greedy output equal to plain decoding in
bfloat16 (where any change of summation order can flip a near-tie).
"""

import pytest
import torch
from lmplug_attention.paged.backend import PagedAttention, PagedAttentionOptions
from lmplug_attention.paged.rows import leading_short_queries, query_rows

from lmplug.api import KVLayerView, StepContext
from lmplug.kit.draft_tree import ancestor_mask

H, HKV, D, BS = 6, 2, 16, 4


def step(att, view, seqs, q, k, v, query_masks=None):
    """One attention call over ``seqs`` = [(block table, cached, new)] with q/k/v for the new tokens
    (``query_masks``: sequence index -> its draft tree's ancestor mask)."""
    width = max(len(t) for t, _, _ in seqs)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _, _ in seqs], dtype=torch.int32)
    positions = [p for _, c, n in seqs for p in range(c, c + n)]
    owner = [i for i, (_, _, n) in enumerate(seqs) for _ in range(n)]
    pos = torch.tensor(positions)
    slots = tables[torch.tensor(owner), pos // BS].long() * BS + pos % BS
    qlens = [n for _, _, n in seqs]
    cu = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes][2] == 1 and seqs[num_decodes][1] > 0:
        num_decodes += 1
    ctx = StepContext(positions=pos, query_lens=torch.tensor(qlens, dtype=torch.int32),
                      seq_lens=torch.tensor([c + n for _, c, n in seqs], dtype=torch.int32),
                      cu_query_lens=cu, slot_mapping=slots, block_tables=tables, query_lens_cpu=qlens,
                      seq_lens_cpu=[c + n for _, c, n in seqs], num_decodes=num_decodes,
                      query_masks=query_masks or {})
    return att.forward(0, q, k, v, view, ctx), ctx


@pytest.mark.parametrize("cpu_kernel", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_token_attends_exactly_as_when_decoded_alone(cpu_kernel, dtype):
    g = torch.Generator().manual_seed(0)
    att = PagedAttention(PagedAttentionOptions(kernels="torch", cpu_kernel=cpu_kernel), num_heads=H,
                         num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)
    pool = torch.randn(64, BS, HKV, D, generator=g).to(dtype)
    a_table, b_table = [5, 17, 3, 40, 9, 22, 31], [11, 2, 60, 7, 13, 50]
    cached_a, cached_b, n = 19, 9, 5  # sequence a verifies n tokens; b decodes beside it
    q = torch.randn(n + 1, H, D, generator=g).to(dtype)
    k = torch.randn(n + 1, HKV, D, generator=g).to(dtype)
    v = torch.randn(n + 1, HKV, D, generator=g).to(dtype)

    view = KVLayerView(pool.clone(), pool.clone() * 0.5, "paged")
    together, ctx = step(att, view, [(b_table, cached_b, 1), (a_table, cached_a, n)], q, k, v)
    assert leading_short_queries(ctx) == 2 and query_rows(ctx, 2).seq_lens_cpu == [10, 20, 21, 22, 23, 24]

    view = KVLayerView(pool.clone(), pool.clone() * 0.5, "paged")
    alone = [step(att, view, [(b_table, cached_b, 1)], q[:1], k[:1], v[:1])[0]]
    for j in range(n):  # a's tokens decoded one step at a time
        alone.append(step(att, view, [(a_table, cached_a + j, 1)], q[1 + j:2 + j], k[1 + j:2 + j],
                          v[1 + j:2 + j])[0])
    if cpu_kernel == "native":  # one task per row, positions in order: nothing depends on the batch
        assert torch.equal(together, torch.cat(alone))
    else:  # paged_cpu's batched matmuls over a padded context may sum in another order
        torch.testing.assert_close(together, torch.cat(alone), atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                   rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_attends_exactly_as_its_path_decoded_alone(dtype):
    """Native kernel: a draft tree is read as masked decode rows. Each node's output equals,
    bit for bit, decoding its root-to-node path one token at a time (the K/V of its ancestors
    at consecutive positions, where the engine moves an accepted path)."""
    g = torch.Generator().manual_seed(1)
    att = PagedAttention(PagedAttentionOptions(kernels="torch", cpu_kernel="native"), num_heads=H,
                         num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)
    pool = torch.randn(64, BS, HKV, D, generator=g).to(dtype)
    table, b_table = [5, 17, 3, 40, 9, 22, 31, 44], [11, 2, 60, 7, 13]
    parents = [-1, -1, 0, 0, 1, 2, 5, -1, 6, 3]  # a tree over 10 drafts (query token j + 1)
    n, cached, cached_b = len(parents) + 1, 21, 6
    q = torch.randn(n + 1, H, D, generator=g).to(dtype)  # row 0: b's decode
    k = torch.randn(n + 1, HKV, D, generator=g).to(dtype)
    v = torch.randn(n + 1, HKV, D, generator=g).to(dtype)
    view = KVLayerView(pool.clone(), pool.clone() * 0.5, "paged")
    mask = ancestor_mask(parents)
    together, ctx = step(att, view, [(b_table, cached_b, 1), (table, cached, n)], q, k, v, {1: mask})
    assert leading_short_queries(ctx, trees=True) == 2 and leading_short_queries(ctx) == 1
    for j in range(n):  # query token j: its path's tokens, decoded in order on a fresh cache
        path = [a for a in range(j + 1) if mask[j, a]]
        view = KVLayerView(pool.clone(), pool.clone() * 0.5, "paged")
        for d, a in enumerate(path):
            out, _ = step(att, view, [(table, cached + d, 1)], q[1 + a:2 + a], k[1 + a:2 + a], v[1 + a:2 + a])
        assert torch.equal(together[1 + j], out[0]), f"query token {j} (path {path})"
    alone, _ = step(att, KVLayerView(pool.clone(), pool.clone() * 0.5, "paged"), [(b_table, cached_b, 1)],
                    q[:1], k[:1], v[:1])
    assert torch.equal(together[0], alone[0])


def test_long_queries_and_trees_without_row_masks_stay_on_the_prefill_path():
    def ctx_of(qlens, trees=()):
        return StepContext(positions=torch.zeros(sum(qlens), dtype=torch.long),
                           query_lens=torch.tensor(qlens), seq_lens=torch.tensor(qlens),
                           cu_query_lens=torch.tensor([0] + qlens).cumsum(0),
                           slot_mapping=torch.zeros(sum(qlens), dtype=torch.long),
                           block_tables=torch.zeros(len(qlens), 1, dtype=torch.int32), query_lens_cpu=qlens,
                           seq_lens_cpu=qlens, num_decodes=0, query_masks={i: None for i in trees})

    assert leading_short_queries(ctx_of([1, 3, 32, 33, 2])) == 3
    assert leading_short_queries(ctx_of([1, 3, 4], trees=[1])) == 1
    assert leading_short_queries(ctx_of([1, 3, 4], trees=[1]), trees=True) == 3  # a kernel with row masks
    assert leading_short_queries(ctx_of([1, 65, 4], trees=[1]), trees=True) == 1  # over 64 bits
    rows = query_rows(ctx_of([2, 3]), 2)
    assert (rows.num_seqs, rows.num_tokens, rows.seq_lens_cpu) == (2, 5, [1, 2, 1, 2, 3])
