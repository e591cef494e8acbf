"""MLA decode split-K: the partitioned Triton decode (``mla_kernels``) equals the PyTorch reference
(``mla_ref.mla_decode_latent``), which equals plain float64 softmax attention over the rows.

Sequences of very different lengths share one launch, so some partitions of the shorter ones
are empty (their weight must be 0); blocks sit shuffled in the pool, slots no sequence owns hold
NaN (a partition that reads past its context leaks NaN), and the output starts as whatever
``torch.empty`` gives (a head the kernel or the reduce forgets fails). Small sizes: the kernels
run under the interpreter on CPU, or compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from lmplug_attention.decode_ops import MAX_SPLITS, plan_decode
from lmplug_attention.mla import kernels as mla_kernels
from lmplug_attention.mla import ref as mla_ref
from lmplug_attention.mla.backend import MLAAttention, MLAOptions

from lmplug.kit.devices import target_capability

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
RANK, ROPE = 24, 8  # neither a power of two: both parts are masked tiles


def paged_rows(seq_lens, block_size=4, seed=0, dtype=torch.float32):
    """A pool holding each sequence's random rows [latent | k_pe] at shuffled blocks; NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.full((num_blocks, block_size, 1, RANK + ROPE), float("nan"), dtype=dtype)
    tables, rows = [], []
    for n, blocks in zip(seq_lens, per_seq):
        table, order = order[:blocks], order[blocks:]
        r = torch.randn(n, RANK + ROPE, generator=g, dtype=torch.float64)
        for p in range(n):
            cache[table[p // block_size], p % block_size, 0] = r[p].to(dtype)
        tables.append(table + [0] * (max(per_seq) - blocks))
        rows.append(r)
    return cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), rows


def float64_attention(q, rows, scale):
    """q [H, R + rope] over rows [S, R + rope]: softmax(q rows^T * scale) @ latent, in float64."""
    probs = (q.double() @ rows.T * scale).softmax(-1)
    return probs @ rows[:, :RANK]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_decode_matches_the_reference(kernel_device, dtype, num_splits):
    # asked 7, the plan cuts 70 keys into 5 partitions of 16: sequences 1 and 3 leave 4 of them empty
    seq_lens = [70, 5, 33, 1]
    cache, tables, lens, rows = paged_rows(seq_lens, dtype=dtype)
    heads = 20  # two head tiles, the second partly masked
    q = torch.randn(len(seq_lens), heads, RANK + ROPE, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = 0.3
    dev = kernel_device
    ours = mla_kernels.mla_decode_latent(q.to(dev), cache.to(dev), tables.to(dev), lens.to(dev), scale, RANK,
                                         max_seq_len=max(seq_lens), num_splits=num_splits).cpu()
    ref = mla_ref.mla_decode_latent(q, cache, tables, lens, scale, RANK)
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    for b, r in enumerate(rows):  # and the reference is the attention it claims to be
        torch.testing.assert_close(ref[b].double(), float64_attention(q[b], r, scale), **TOL[dtype])


def test_planned_split_at_batch_one_matches_unsplit(kernel_device):
    """Batch 1, one head tile, a context long enough that the plan splits it (>= 2 x 256 keys)."""
    cache, tables, lens, _ = paged_rows([700], block_size=16, seed=3)
    q = torch.randn(1, 16, RANK + ROPE, generator=torch.Generator().manual_seed(4))
    splits, partition = plan_decode(1, 1, 700, None, mla_kernels.MLA_TABLE[None][1], None, 132)
    assert splits == 2 and partition == 352  # what the planned call runs on CPU (the interpreter)
    dev = kernel_device
    args = (q.to(dev), cache.to(dev), tables.to(dev), lens.to(dev), 0.2, RANK)
    planned = mla_kernels.mla_decode_latent(*args, max_seq_len=700).cpu()
    single = mla_kernels.mla_decode_latent(*args, max_seq_len=700, num_splits=1).cpu()
    torch.testing.assert_close(planned, single, **TOL[torch.float32])
    torch.testing.assert_close(planned, mla_ref.mla_decode_latent(q, cache, tables, lens, 0.2, RANK),
                               **TOL[torch.float32])


def test_split_count_follows_batch_and_head_tiles_against_the_sm_count():
    """Split only while (sequence, head tile) programs leave SMs idle: at 108+ programs on an
    A100 none, on an H100 (132 SMs) still two."""
    with target_capability((8, 0)):
        assert plan_decode(108, 1, 8192, None, 16, None, mla_kernels.num_sms(torch.device("cpu")))[0] == 1
    with target_capability((9, 0)):
        assert plan_decode(108, 1, 8192, None, 16, None, mla_kernels.num_sms(torch.device("cpu")))[0] == 3


def test_bad_split_counts_are_refused():
    cache, tables, lens, _ = paged_rows([5])
    q = torch.zeros(1, 4, RANK + ROPE)
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match=rf"num_splits must be None or in \[1, {MAX_SPLITS}\], got {bad}"):
            mla_kernels.mla_decode_latent(q, cache, tables, lens, 0.1, RANK, num_splits=bad)


def test_tf32_is_an_opt_in_of_the_backend(kernel_device):
    exact = MLAAttention(MLAOptions(kernels="triton"), num_heads=4, num_kv_heads=1, head_dim=RANK + ROPE,
                         scale=0.1)
    fast = MLAAttention(MLAOptions(kernels="triton", allow_tf32=True), num_heads=4, num_kv_heads=1,
                        head_dim=RANK + ROPE, scale=0.1)
    device = torch.device(kernel_device)
    assert exact.decode_latent_op(device).keywords == {"allow_tf32": False}
    assert fast.decode_latent_op(device).keywords == {"allow_tf32": True}
