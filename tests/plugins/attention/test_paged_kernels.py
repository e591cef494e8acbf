"""PagedAttention: the Triton kernels (on ``kernel_device``: the CPU under TRITON_INTERPRET=1, or
compiled on a CUDA GPU) against the PyTorch references
(``kv_ref``, ``decode_ref``, ``prefill_ref``), and the references and the backend's PyTorch prefill
(``paged_torch``) against plain attention computed from each sequence's contiguous K/V.

Blocks are handed out in random order, unused slots hold NaN, block tables are
padded with real block ids, and outputs start as NaN, so a kernel that lets a
slot outside a sequence reach the output or leaves a row unwritten fails. bf16 runs on
CUDA sm_80+ only: ``tl.dot`` on bf16 is broken under the interpreter (see
docs/triton-on-cpu.md); fp32 and fp16 exercise the same code there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from lmplug_attention import kv_ops, kv_ref
from lmplug_attention.decode_ref import decode_attention
from lmplug_attention.paged import kernels as tk
from lmplug_attention.paged import prefill_kernels as tpk
from lmplug_attention.paged import torch_path as paged_torch
from lmplug_attention.prefill_ref import prefill_attention
from support.devices import bf16_param

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 3e-3, "rtol": 3e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
KERNEL_DTYPES = [torch.float32, torch.float16, bf16_param()]
HEAD_DIM = 32
NUM_KV_HEADS = 2


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [N, bs, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    k: list[torch.Tensor]  # per sequence, contiguous [S, Hkv, D]
    v: list[torch.Tensor]

    def to(self, device: str) -> PagedCase:
        """The pool, tables and lengths on ``device`` (per-sequence K/V stay on the CPU)."""
        return PagedCase(self.k_cache.to(device), self.v_cache.to(device), self.block_tables.to(device),
                         self.seq_lens.to(device), self.k, self.v)


def make_case(seq_lens: list[int], block_size: int, dtype: torch.dtype, seed: int = 0) -> PagedCase:
    """Each sequence's K/V scattered over randomly ordered blocks of one pool."""
    g = torch.Generator().manual_seed(seed)
    counts = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(counts) + 3
    order = torch.randperm(num_blocks, generator=g)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)  # garbage wherever no token lives
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = max(counts) + 1
    tables = order[:width].repeat(len(seq_lens), 1)  # padding entries are real block ids
    ks, vs, used = [], [], 0
    for i, n in enumerate(seq_lens):
        blocks = order[used:used + counts[i]]
        used += counts[i]
        tables[i, :counts[i]] = blocks
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        slots = blocks.repeat_interleave(block_size)[:n] * block_size + torch.arange(n) % block_size
        k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k
        v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v
        ks.append(k)
        vs.append(v)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedCase(k_cache, v_cache, tables.to(torch.int32), lens, ks, vs)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q [L, H, D] = the last L positions of k, v [S, Hkv, D]; fp32 softmax(q k^T) v, K/V repeated."""
    query_len, num_heads, _ = q.shape
    seq_len = k.shape[0]
    group = num_heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [H, L, S]
    q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1)  # [L, H, D]


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


# -- reshape_and_cache ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_reshape_and_cache_matches_reference(dtype, kernel_device):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 16, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(9, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(9, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    slots = torch.randperm(6 * 16, generator=g)[:9]
    slots[4] = -1  # padding: skipped
    caches = [(cache.clone(), cache.clone()) for _ in range(2)]
    kv_ref.reshape_and_cache(k, v, *caches[0], slots)
    on = [t.to(kernel_device) for t in (k, v, *caches[1], slots)]
    kv_ops.reshape_and_cache(*on)
    caches[1] = (on[2].cpu(), on[3].cpu())
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    flat = caches[1][0].view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[slots[0]], k[0])
    assert torch.equal(flat[slots[5]], k[5])


def test_reshape_and_cache_rejects_mismatched_shapes():
    cache = torch.zeros(2, 16, 2, 32)
    with pytest.raises(ValueError, match="must be \\[T, Hkv, D\\]"):
        kv_ops.reshape_and_cache(torch.zeros(3, 4, 32), torch.zeros(3, 4, 32), cache, cache.clone(),
                                 torch.zeros(3, dtype=torch.int64))


# -- decode -------------------------------------------------------------------------------------

DECODE_LENS = [1, 37, 150]  # one token, a few blocks, many blocks


def _decode_inputs(group: int, block_size: int, dtype: torch.dtype, lens=DECODE_LENS):
    case = make_case(lens, block_size, dtype)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(lens), NUM_KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    return case, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_reference_matches_plain_attention(dtype, group):
    case, q = _decode_inputs(group, 16, dtype)
    scale = HEAD_DIM ** -0.5
    out = decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    for i in range(len(DECODE_LENS)):
        expected = plain_attention(q[i:i + 1], case.k[i], case.v[i], scale)[0]
        torch.testing.assert_close(out[i].float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_kernel_matches_reference(dtype, group, block_size, kernel_device):
    case, q = _decode_inputs(group, block_size, dtype)
    case, q = case.to(kernel_device), q.to(kernel_device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.3)
    expected = decode_attention(*args)
    out = tk.paged_decode_attention(*args, partition_size=0, out=nan_like(q))
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_decode_split_k_matches_reference(dtype, group, kernel_device):
    case, q = _decode_inputs(group, 16, dtype)
    case, q = case.to(kernel_device), q.to(kernel_device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.3)
    expected = decode_attention(*args)
    out = tk.paged_decode_attention(*args, partition_size=64, out=nan_like(q))
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("partition_size", [0, 32])
def test_decode_sliding_window(partition_size, kernel_device):
    case, q = _decode_inputs(2, 16, torch.float32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.3)
    expected = decode_attention(*args, sliding_window=40)
    for i in range(len(DECODE_LENS)):
        plain = plain_attention(q[i:i + 1], case.k[i], case.v[i], 0.3, window=40)[0]
        torch.testing.assert_close(expected[i], plain, **TOL[torch.float32])
    case, q, expected = case.to(kernel_device), q.to(kernel_device), expected.to(kernel_device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.3)
    out = tk.paged_decode_attention(*args, sliding_window=40, partition_size=partition_size, out=nan_like(q))
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.slow  # ~20 s under the interpreter
def test_decode_long_context_takes_the_split_path_and_matches(kernel_device):
    """33k tokens: the kernel loops over 2k+ blocks; the automatic choice splits (batch of 1)."""
    lens = [33_000]
    case = make_case(lens, 16, torch.float32, seed=3)
    q = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    expected = plain_attention(q, case.k[0], case.v[0], HEAD_DIM ** -0.5)
    case, q = case.to(kernel_device), q.to(kernel_device)
    expected = expected.to(kernel_device)
    assert tk.choose_partition_size(1, NUM_KV_HEADS, lens[0], q.device) is not None
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, HEAD_DIM ** -0.5)
    torch.testing.assert_close(decode_attention(*args), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tk.paged_decode_attention(*args, out=nan_like(q)), expected,
                               atol=1e-5, rtol=1e-4)


def test_decode_rejects_bad_inputs():
    case, q = _decode_inputs(1, 16, torch.float32)
    with pytest.raises(ValueError, match="share one dtype"):
        tk.paged_decode_attention(q.half(), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        tk.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables.long(), case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="partition_size"):
        tk.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0,
                                  partition_size=24)


# -- prefill ------------------------------------------------------------------------------------

# (cached prefix, new tokens) per sequence: nothing cached, a cached prefix, a one-token
# query after a prefix, a long chunk after a prefix that ends mid-block
PREFILL = [(0, 20), (32, 17), (45, 1), (70, 40)]


def _prefill_inputs(group: int, block_size: int, dtype: torch.dtype):
    lens = [c + n for c, n in PREFILL]
    case = make_case(lens, block_size, dtype, seed=5)
    query_lens = [n for _, n in PREFILL]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(int(cu[-1]), NUM_KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    return case, q, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("prefill", [prefill_attention, paged_torch.paged_prefill_attention],
                         ids=["reference", "paged_torch"])
def test_prefill_reference_matches_plain_attention(dtype, group, prefill):
    case, q, cu = _prefill_inputs(group, 16, dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.3)
    out = prefill(*args)
    for i in range(len(PREFILL)):
        s, e = int(cu[i]), int(cu[i + 1])
        expected = plain_attention(q[s:e], case.k[i], case.v[i], 0.3)
        torch.testing.assert_close(out[s:e].float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype,group,block_size", [
    (torch.float32, 1, 16), (torch.float32, 4, 32), (torch.float16, 4, 16), (torch.float16, 1, 32),
    bf16_param(torch.bfloat16, 4, 16, id="bf16-4-16")])
def test_prefill_kernel_matches_reference(dtype, group, block_size, kernel_device):
    case, q, cu = _prefill_inputs(group, block_size, dtype)
    case, q, cu = case.to(kernel_device), q.to(kernel_device), cu.to(kernel_device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.3)
    expected = prefill_attention(*args)
    out = tpk.paged_prefill_attention(*args, out=nan_like(q))
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_prefill_sliding_window(kernel_device):
    case, q, cu = _prefill_inputs(2, 16, torch.float32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.3)
    expected = prefill_attention(*args, sliding_window=24)
    s, e = int(cu[3]), int(cu[4])
    plain = plain_attention(q[s:e], case.k[3], case.v[3], 0.3, window=24)
    torch.testing.assert_close(expected[s:e], plain, **TOL[torch.float32])
    cpu = paged_torch.paged_prefill_attention(*args, sliding_window=24, out=nan_like(q))
    torch.testing.assert_close(cpu, expected, **TOL[torch.float32])
    case, q, cu = case.to(kernel_device), q.to(kernel_device), cu.to(kernel_device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.3)
    out = tpk.paged_prefill_attention(*args, sliding_window=24, out=nan_like(q))
    torch.testing.assert_close(out.cpu(), expected, **TOL[torch.float32])
