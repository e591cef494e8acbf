"""MLA attention: the absorbed decode equals the expanded computation.

The ground truth is MLA as the model defines it, in float64: each cached row
``[latent | k_pe]`` expanded per head to K = [latent w_uk^T | k_pe] and
V = latent w_uv^T, then softmax attention. Against it: the PyTorch absorbed
decode (``mla_ref``), the Triton kernel (``mla_kernels``, on ``kernel_device``: the CPU under
``TRITON_INTERPRET=1``, or compiled on a CUDA GPU), the expanded prefill over a cached prefix, and
the ``mla`` backend on a mixed step. Sequences' blocks sit in shuffled order
in the pool, and slots no sequence owns hold NaN.
"""

from __future__ import annotations

import pytest
import torch
from lmplug_attention.mla import kernels as mla_kernels
from lmplug_attention.mla import ref as mla_ref
from lmplug_attention.mla.backend import MLAAttention, MLAOptions
from support.devices import bf16_param

from lmplug.api import BackendOptions, StepContext
from lmplug.interfaces.attention import KVLayerView

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


class Case:
    """Random MLA weights and a paged cache holding ``seq_lens`` rows per sequence, blocks shuffled."""

    def __init__(self, seq_lens, *, heads=4, rank=32, rope=8, nope=16, v=12, block_size=4,
                 dtype=torch.float32, seed=0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.heads, self.rank, self.dtype = list(seq_lens), heads, rank, dtype
        self.scale = (nope + rope) ** -0.5 * 1.3  # a yarn-like mscale^2, not the default

        def rand(*shape, s=1.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * s)

        self.w_uk = rand(heads, nope, rank, s=rank ** -0.5)
        self.w_uv = rand(heads, v, rank, s=rank ** -0.5)
        self.rows = [rand(n, rank + rope) for n in self.seq_lens]  # each sequence's cached rows
        per_seq = [-(-n // block_size) for n in self.seq_lens]
        num_blocks = sum(per_seq) + 3
        order = torch.randperm(num_blocks, generator=g).tolist()
        self.tables = []
        for n in per_seq:
            self.tables.append(order[:n])
            order = order[n:]
        width = max(per_seq)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        self.cache = torch.full((num_blocks, block_size, 1, rank + rope), float("nan"), dtype=dtype)
        for table, rows in zip(self.tables, self.rows):
            slots = self.slots(table, range(rows.shape[0]))
            self.cache.view(-1, rank + rope)[slots] = rows.to(dtype)
        self.q_nope = [rand(n, heads, nope) for n in self.seq_lens]
        self.q_pe = [rand(n, heads, rope) for n in self.seq_lens]

    def slots(self, table, positions) -> torch.Tensor:
        bs = self.cache.shape[1]
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.int64)

    def expanded(self, i: int, query_len: int) -> torch.Tensor:
        """float64 truth for the last ``query_len`` positions of sequence i: [L, H, V]."""
        rows = self.rows[i].to(self.dtype).double()  # what the cache holds
        k, v = mla_ref.expand_kv(rows, self.w_uk.to(self.dtype).double(), self.w_uv.to(self.dtype).double())
        q = torch.cat([self.q_nope[i], self.q_pe[i]], dim=-1)[-query_len:].to(self.dtype).double()
        scores = torch.einsum("lhd,hsd->hls", q, k) * self.scale
        n = rows.shape[0]
        q_pos = torch.arange(n - query_len, n).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(n).unsqueeze(0) > q_pos, float("-inf"))
        return torch.einsum("hls,hsv->lhv", scores.softmax(-1), v)

    def decode_inputs(self, device: str = "cpu"):
        q_nope = torch.stack([q[-1] for q in self.q_nope]).to(self.dtype)  # [B, H, nope]
        q_pe = torch.stack([q[-1] for q in self.q_pe]).to(self.dtype)
        tensors = (q_nope, q_pe, self.w_uk.to(self.dtype), self.w_uv.to(self.dtype), self.cache,
                   self.block_tables, torch.tensor(self.seq_lens, dtype=torch.int32))
        return (*(t.to(device) for t in tensors), self.scale)


DECODE_CASES = {
    "small": {"seq_lens": [1, 7, 33]},
    "block16_long": {"seq_lens": [70, 5], "block_size": 16},
    # widths that are not powers of two
    "odd_widths": {"seq_lens": [9, 20], "rank": 24, "rope": 6, "nope": 10, "v": 7},
    "many_heads": {"seq_lens": [12, 3], "heads": 20},  # two head tiles, the second partly masked
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_absorbed_decode_equals_expanded(name, kernel, dtype, kernel_device):
    case = Case(**DECODE_CASES[name], dtype=dtype)
    op = mla_ref.mla_decode_latent if kernel == "torch" else mla_kernels.mla_decode_latent
    device = "cpu" if kernel == "torch" else kernel_device
    out = mla_ref.mla_decode_attention(*case.decode_inputs(device), decode_latent=op)
    expected = torch.cat([case.expanded(i, 1) for i in range(len(case.seq_lens))])
    torch.testing.assert_close(out.double().cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   bf16_param()])
@pytest.mark.parametrize("seq_lens,block_size", [pytest.param([3, 18, 40], 8, id="short"),
                                                 pytest.param([1000, 37], 16, id="long-context")])
def test_triton_latent_decode_equals_reference(dtype, seq_lens, block_size, kernel_device):
    case = Case(seq_lens, block_size=block_size, dtype=dtype, seed=1)
    q_nope, q_pe, w_uk, _, cache, tables, lens, scale = case.decode_inputs(kernel_device)
    q = mla_ref.absorb_query(q_nope, q_pe, w_uk)
    ours = mla_kernels.mla_decode_latent(q, cache, tables, lens, scale, case.rank)
    ref = mla_ref.mla_decode_latent(q, cache, tables, lens, scale, case.rank)
    torch.testing.assert_close(ours, ref, **TOL[dtype])


def test_prefill_over_a_cached_prefix_equals_expanded():
    case = Case([10, 23], block_size=4, seed=2)
    query_lens = [10, 6]  # the first a whole prompt, the second 17 cached + 6 new
    q_nope = torch.cat([q[-n:] for q, n in zip(case.q_nope, query_lens)]).float()
    q_pe = torch.cat([q[-n:] for q, n in zip(case.q_pe, query_lens)]).float()
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    out = mla_ref.mla_prefill_attention(q_nope, q_pe, case.w_uk.float(), case.w_uv.float(), case.cache,
                                        case.block_tables, cu, torch.tensor(case.seq_lens), case.scale)
    expected = torch.cat([case.expanded(i, n) for i, n in enumerate(query_lens)])
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_backend_mixed_step_writes_rows_and_attends(kernels, kernel_device):
    """Two decodes and a prefill in one step: new rows land at their slots, every output matches."""
    device = "cpu" if kernels == "torch" else kernel_device
    case = Case([14, 6, 9], block_size=4, seed=3)
    query_lens = [1, 1, 9]
    new_rows = torch.cat([rows[-n:] for rows, n in zip(case.rows, query_lens)]).float()
    slots = torch.cat([case.slots(t, range(s - n, s))
                       for t, s, n in zip(case.tables, case.seq_lens, query_lens)])
    case.cache.view(-1, case.cache.shape[-1])[slots] = float("nan")  # written by the step itself
    backend = MLAAttention(MLAOptions(kernels=kernels), num_heads=case.heads, num_kv_heads=1,
                           head_dim=case.cache.shape[-1], scale=case.scale)

    def on(values, dtype=None) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device)

    ctx = StepContext(
        positions=on(torch.cat([torch.arange(s - n, s) for s, n in zip(case.seq_lens, query_lens)])),
        query_lens=on(query_lens, torch.int32), seq_lens=on(case.seq_lens, torch.int32),
        cu_query_lens=on([0, 1, 2, 11], torch.int32), slot_mapping=on(slots),
        block_tables=on(case.block_tables), query_lens_cpu=query_lens, seq_lens_cpu=case.seq_lens,
        num_decodes=2)
    q_nope = on(torch.cat([q[-n:] for q, n in zip(case.q_nope, query_lens)]).float())
    q_pe = on(torch.cat([q[-n:] for q, n in zip(case.q_pe, query_lens)]).float())
    cache = on(case.cache)
    kv = KVLayerView(cache, cache[..., :0], "paged")
    out = backend.forward_mla(0, q_nope, q_pe, on(new_rows[:, :case.rank]), on(new_rows[:, case.rank:]),
                              on(case.w_uk.float()), on(case.w_uv.float()), kv, ctx)
    torch.testing.assert_close(cache.view(-1, cache.shape[-1])[on(slots)].cpu(), new_rows)
    expected = torch.cat([case.expanded(i, n) for i, n in enumerate(query_lens)])
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


def test_plain_forward_is_refused():
    backend = MLAAttention(MLAOptions(), num_heads=2, num_kv_heads=1, head_dim=8, scale=1.0)
    with pytest.raises(TypeError, match="forward_mla"):
        backend.forward(0, *[torch.zeros(1, 2, 8)] * 3, None, None)
    assert isinstance(MLAOptions(), BackendOptions)
