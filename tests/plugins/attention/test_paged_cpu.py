"""The CPU decode path of attention `paged` against the PyTorch reference (decode_ref)."""

import pytest
import torch
from lmplug_attention.decode_ref import decode_attention
from lmplug_attention.paged.cpu import decode_index, paged_decode_attention_cpu


def _paged_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random caches with each sequence's blocks scattered over the pool, garbage in unused slots."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    pool = sum(blocks) + 3
    k_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(pool, generator=g)
    width = max(blocks) + 2  # table padding past every sequence's last block
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = order[used:used + nb]
        tables[i, nb:] = order[-1]  # padding points at a block of another sequence's data
        used += nb
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_reference_fp32(num_heads, num_kv_heads, block_size, window):
    lens = [1, 7, 16, 33, 2]
    q, kc, vc, tables, seq_lens = _paged_batch(lens, num_heads, num_kv_heads, 8, block_size, torch.float32)
    scale = 8 ** -0.5
    ref = decode_attention(q, kc, vc, tables, seq_lens, scale, sliding_window=window)
    index = decode_index(tables, seq_lens, block_size, num_kv_heads, max(lens), window)
    out = torch.empty_like(q)
    got = paged_decode_attention_cpu(q, kc, vc, index, scale, out=out)
    assert got is out
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_matches_reference_bf16_and_ignores_nan_in_unused_slots():
    lens = [5, 40, 17]
    q, kc, vc, tables, seq_lens = _paged_batch(lens, 6, 2, 16, 16, torch.bfloat16, seed=3)
    # slots past each sequence's end hold NaN: a zero weight must not turn them into NaN output
    for i, n in enumerate(lens):
        last = int(tables[i, (n - 1) // 16])
        kc[last, n % 16 or 16:] = float("nan")
        vc[last, n % 16 or 16:] = float("nan")
    scale = 0.25
    got = paged_decode_attention_cpu(q, kc, vc, decode_index(tables, seq_lens, 16, 2, max(lens)), scale)
    # the float64 reference over exactly the valid slots
    for i, n in enumerate(lens):
        slots = [int(tables[i, p // 16]) * 16 + p % 16 for p in range(n)]
        k = kc.view(-1, 2, 16)[slots].double()  # [n, Hkv, D]
        v = vc.view(-1, 2, 16)[slots].double()
        qi = q[i].double().view(2, 3, 16)
        w = torch.softmax(torch.einsum("hgd,shd->hgs", qi, k) * scale, -1)
        want = torch.einsum("hgs,shd->hgd", w, v).reshape(6, 16)
        assert torch.isfinite(got[i]).all()
        torch.testing.assert_close(got[i].double(), want, atol=2e-2, rtol=2e-2)
