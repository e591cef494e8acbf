"""Lightning attention (MiniMax): the PyTorch reference and the Triton kernels against transformers.

The ground truth is ``transformers``' ``MiniMaxLightningAttention`` with random weights (a tiny
``MiniMaxConfig``: hidden 64, 4 heads of 16, block_size 8). The test rebuilds the layer's output from
its weights around our ops: qkv projection, silu, the lightning op over flattened sequences, RMSNorm,
sigmoid output gate, out_proj. transformers runs one sequence at a time (a batch of one each); its
block path covers fresh prompts, its token-by-token path a non-zero initial state and decode.

Then: chunked prefill (state carried) == one pass; T decode steps == the prefill over the same
T tokens; the Triton kernels (on ``kernel_device``: the CPU under ``TRITON_INTERPRET=1``, or a CUDA GPU)
== the reference at small sizes, fp32 and fp16 (bf16 where a GPU runs it). Prefill and decode on
a pool of state slots (``state_indices``, slots shuffled, more slots than sequences) == on the
gathered per-batch states, other slots left bit-identical.

Tolerances: fp32 ``atol = rtol = 1e-5`` on the layer outputs and states (both sides compute in fp32,
in a different order); fp16 kernel inputs ``atol = rtol = 1e-2`` (products rounded to fp16), bf16 5e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lmplug_mixer import lightning_kernels, lightning_ref
from support.devices import NO_KERNEL_DEVICE, bf16_param, kernel_device
from support.state_pools import others, pool_with
from transformers import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

HIDDEN, HEADS, HEAD_DIM = 64, 4, 16
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
FP32 = {"atol": 1e-5, "rtol": 1e-5}
TOL = {torch.float32: FP32, torch.float16: {"atol": 1e-2, "rtol": 1e-2},
       torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2}}


def make_layer(layer_idx: int, *, num_heads: int = HEADS, num_layers: int = 4, seed: int = 0):
    """A transformers lightning layer with random weights (RMSNorm weight too, not all ones)."""
    config = MiniMaxConfig(hidden_size=HIDDEN, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                           head_dim=HEAD_DIM, num_hidden_layers=num_layers, block_size=8, intermediate_size=32,
                           num_local_experts=2, num_experts_per_tok=1,
                           layer_types=(LAYER_TYPES * num_layers)[:num_layers])
    torch.manual_seed(seed)
    layer = MiniMaxLightningAttention(config, layer_idx).eval()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


def project(layer, x: torch.Tensor):
    """x [T, hidden] -> q, k, v [T, H, D]: strided views of one silu(qkv) tensor, as a model passes them."""
    qkv = F.silu(x @ layer.qkv_proj.weight.T).view(x.shape[0], HEADS, 3 * HEAD_DIM)
    return qkv.split(HEAD_DIM, dim=-1)


def finish(layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """o [T, H, D] -> the layer output [T, hidden]: RMSNorm, sigmoid gate from x, out_proj."""
    o = o.reshape(o.shape[0], -1).float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm.variance_epsilon) * layer.norm.weight
    return (torch.sigmoid(x @ layer.output_gate.weight.T) * o) @ layer.out_proj.weight.T


def cu(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def hf_run(layer, x: torch.Tensor, state: torch.Tensor | None = None, cache: MiniMaxCache | None = None):
    """One sequence through transformers: x [L, hidden] -> (out [L, hidden], state [H, D, D])."""
    if x.shape[0] == 0 and state is not None:  # transformers cannot take an empty sequence: nothing changes
        return x, state
    if state is not None:
        cache = MiniMaxCache()
        cache.set_linear_cache(layer.layer_idx, state[None].clone())
    with torch.no_grad():
        out, final = layer(x[None], position_embeddings=None, attention_mask=None, cache=cache)
    return out[0], final[0]


@pytest.fixture(params=["torch", pytest.param("triton", marks=pytest.mark.skipif(
    kernel_device() is None, reason=NO_KERNEL_DEVICE))])
def ops(request):
    """(prefill, decode, device): the reference on the CPU or the Triton kernels on the kernel device."""
    if request.param == "torch":
        return lightning_ref.lightning_attention_prefill, lightning_ref.lightning_attention_decode, "cpu"
    return (lightning_kernels.lightning_attention_prefill, lightning_kernels.lightning_attention_decode,
            kernel_device())


def run_prefill(ops, layer, x, lens, initial_state=None, **kw):
    """Our layer over flattened sequences: (out [T, hidden], final_state [B, H, D, D]) on the CPU."""
    prefill, _, device = ops
    q, k, v = project(layer, x)
    init = None if initial_state is None else initial_state.to(device)
    o, final = prefill(*(t.to(device) for t in (q, k, v, layer.slope_rate.flatten(), cu(lens))), init, **kw)
    return finish(layer, x, o.cpu()), final.cpu()


@pytest.mark.parametrize("num_heads, layer_idx, num_layers", [(4, 0, 4), (4, 2, 4), (8, 3, 4), (64, 7, 80)])
def test_slopes_equal_module(num_heads, layer_idx, num_layers):
    layer = make_layer(layer_idx, num_heads=num_heads, num_layers=num_layers)
    torch.testing.assert_close(lightning_ref.lightning_slopes(num_heads, layer_idx, num_layers),
                               layer.slope_rate.flatten())


@pytest.mark.parametrize("layer_idx", [0, 2])
@pytest.mark.parametrize("block_size", [8, 5, 256])
def test_reference_prefill_equals_module(layer_idx, block_size):
    """Fresh prompts of lengths around the module's block of 8; our block size is free."""
    layer = make_layer(layer_idx)
    lens = [13, 1, 8, 21]
    x = torch.randn(sum(lens), HIDDEN)
    out, final = run_prefill((lightning_ref.lightning_attention_prefill, None, "cpu"), layer, x, lens,
                             block_size=block_size)
    expected = [hf_run(layer, xs) for xs in x.split(lens)]
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), **FP32)
    torch.testing.assert_close(final, torch.stack([e[1] for e in expected]), **FP32)


def test_prefill_equals_module(ops):
    """Both ops: fresh prompts, several lengths flattened (the Triton walk takes 16-token blocks)."""
    layer = make_layer(0)
    lens = [19, 1, 33, 7]
    x = torch.randn(sum(lens), HIDDEN)
    out, final = run_prefill(ops, layer, x, lens)
    expected = [hf_run(layer, xs) for xs in x.split(lens)]
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), **FP32)
    torch.testing.assert_close(final, torch.stack([e[1] for e in expected]), **FP32)


def test_initial_state_equals_module(ops):
    """A carried state (transformers then runs token by token) and a zero-length sequence."""
    layer = make_layer(3)
    lens = [11, 0, 20]
    x = torch.randn(sum(lens), HIDDEN)
    init = torch.randn(len(lens), HEADS, HEAD_DIM, HEAD_DIM) * 0.5
    out, final = run_prefill(ops, layer, x, lens, initial_state=init)
    expected = [hf_run(layer, xs, state=s) for xs, s in zip(x.split(lens), init)]
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), **FP32)
    torch.testing.assert_close(final, torch.stack([e[1] for e in expected]), **FP32)


def test_decode_equals_module_cache(ops):
    """Prompts, then three decode steps with transformers' cache; our state is updated in place."""
    _, decode_op, device = ops
    layer = make_layer(2)
    lens, steps = [9, 17], 3
    x = torch.randn(sum(lens), HIDDEN)
    new = torch.randn(steps, len(lens), HIDDEN)
    _, state = run_prefill(ops, layer, x, lens)
    state = state.to(device)
    slope = layer.slope_rate.flatten().to(device)
    caches = [MiniMaxCache() for _ in lens]
    for xs, cache in zip(x.split(lens), caches):
        hf_run(layer, xs, cache=cache)
    for step in range(steps):
        q, k, v = project(layer, new[step])
        o = decode_op(q.to(device), k.to(device), v.to(device), slope, state)
        expected = [hf_run(layer, new[step, i:i + 1], cache=cache)[0] for i, cache in enumerate(caches)]
        torch.testing.assert_close(finish(layer, new[step], o.cpu()), torch.cat(expected), **FP32)
    expected_state = torch.cat([cache.get_linear_cache(layer.layer_idx) for cache in caches])
    torch.testing.assert_close(state.cpu(), expected_state, **FP32)


def random_qkv(total: int, heads: int, head_k: int, head_v: int, dtype: torch.dtype, seed: int = 0):
    """silu-like (mostly positive) q, k [T, H, Dk] and v [T, H, Dv] as strided views of one tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = F.silu(torch.randn(total, heads, 2 * head_k + head_v, generator=g)).to(dtype)
    return qkv.split([head_k, head_k, head_v], dim=-1)


@pytest.mark.parametrize("chunks", [[[5, 9, 3], [12, 0, 20], [4, 7, 1]], [[1, 1, 1], [30, 2, 17]]])
def test_chunked_prefill_equals_one_pass(ops, chunks):
    """Each sequence's tokens in 2-3 chunks, the state carried between calls == one pass."""
    prefill, _, device = ops
    slope = lightning_ref.lightning_slopes(2, 1, 4).to(device)
    lens = [sum(c[i] for c in chunks) for i in range(len(chunks[0]))]
    q, k, v = (t.to(device) for t in random_qkv(sum(lens), 2, 16, 16, torch.float32))
    init = (torch.randn(len(lens), 2, 16, 16) * 0.5).to(device)
    out, final = prefill(q, k, v, slope, cu(lens).to(device), init)
    seq_starts, done, state = cu(lens)[:-1].tolist(), [0] * len(lens), init
    for chunk_lens in chunks:
        rows = torch.cat([torch.arange(s + d, s + d + n) for s, d, n in zip(seq_starts, done, chunk_lens)])
        rows = rows.to(device)
        o, state = prefill(q[rows], k[rows], v[rows], slope, cu(chunk_lens).to(device), state)
        torch.testing.assert_close(o, out[rows], **FP32)
        done = [d + n for d, n in zip(done, chunk_lens)]
    torch.testing.assert_close(state, final, **FP32)


def test_decode_steps_equal_prefill(ops):
    """T single-token steps from a carried state == the prefill over those T tokens (outputs, final state)."""
    prefill, decode, device = ops
    num_seqs, steps = 3, 6
    slope = lightning_ref.lightning_slopes(2, 0, 4).to(device)
    q, k, v = (t.to(device).view(num_seqs, steps, 2, -1) for t in random_qkv(num_seqs * steps, 2, 16, 24,
                                                                              torch.float32))
    init = (torch.randn(num_seqs, 2, 16, 24) * 0.5).to(device)
    flat = [t.reshape(num_seqs * steps, 2, -1) for t in (q, k, v)]
    out, final = prefill(*flat, slope, cu([steps] * num_seqs).to(device), init)
    state = init.clone()
    for t in range(steps):
        o = decode(q[:, t], k[:, t], v[:, t], slope, state)
        torch.testing.assert_close(o, out.view(num_seqs, steps, 2, -1)[:, t], **FP32)
    torch.testing.assert_close(state, final, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, bf16_param()])
@pytest.mark.parametrize("heads, head_k, head_v, block_size",
                         [(2, 16, 16, None), (3, 12, 40, 32), (2, 40, 24, None)])
def test_triton_prefill_equals_reference(dtype, heads, head_k, head_v, block_size, kernel_device):
    """Heads not powers of two, Dk != Dv, value tiles, key lanes in tiles (Dk 40: the interpreter's 16
    lanes at a time, the last tile partial), a zero-length sequence, a carried state."""
    lens = [19, 0, 33, 1]
    q, k, v = random_qkv(sum(lens), heads, head_k, head_v, dtype)
    slope = lightning_ref.lightning_slopes(heads, 1, 5)
    init = torch.randn(len(lens), heads, head_k, head_v) * 0.5
    expected, expected_state = lightning_ref.lightning_attention_prefill(q, k, v, slope, cu(lens), init)
    out, state = lightning_kernels.lightning_attention_prefill(
        *(t.to(kernel_device) for t in (q, k, v, slope, cu(lens), init)), block_size=block_size)
    assert out.dtype == dtype and state.dtype == torch.float32
    torch.testing.assert_close(out.cpu().float(), expected.float(), **TOL[dtype])
    torch.testing.assert_close(state.cpu(), expected_state, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, bf16_param()])
@pytest.mark.parametrize("head_k, head_v", [(16, 16), (12, 80)])
def test_triton_decode_equals_reference(dtype, head_k, head_v, kernel_device):
    """The fused step == the reference step, on a strided state (every other row of a pool), in place."""
    batch, heads = 3, 2
    q, k, v = (t.view(batch, heads, -1) for t in random_qkv(batch, heads, head_k, head_v, dtype))
    slope = lightning_ref.lightning_slopes(heads, 0, 3)
    pool = torch.randn(2 * batch, heads, head_k, head_v) * 0.5
    expected_state = pool[::2].clone()
    expected = lightning_ref.lightning_attention_decode(q, k, v, slope, expected_state)
    pool = pool.to(kernel_device)
    out = lightning_kernels.lightning_attention_decode(*(t.to(kernel_device) for t in (q, k, v, slope)), pool[::2])
    torch.testing.assert_close(out.cpu().float(), expected.float(), **TOL[dtype])
    torch.testing.assert_close(pool[::2].cpu(), expected_state, **FP32)


def test_errors_name_the_problem():
    q = torch.zeros(4, 2, 16)
    slope = torch.ones(2)
    with pytest.raises(ValueError, match="slope must be"):
        lightning_ref.lightning_attention_prefill(q, q, q, torch.ones(3), cu([4]))
    with pytest.raises(ValueError, match="initial_state must be"):
        lightning_ref.lightning_attention_prefill(q, q, q, slope, cu([4]), torch.zeros(1, 2, 16, 8))
    with pytest.raises(ValueError, match="state must be fp32"):
        lightning_ref.lightning_attention_decode(q, q, q, slope, torch.zeros(4, 2, 16, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="power of two"):
        lightning_kernels.lightning_attention_prefill(q, q, q, slope, cu([4]), block_size=24)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_state_pool_equals_per_batch(ops, index_dtype):
    """Prefill (an empty sequence keeps its state), then two decode steps, on a pool == per batch."""
    prefill, decode, device = ops
    tol = {"atol": 0, "rtol": 0} if prefill is lightning_ref.lightning_attention_prefill else FP32
    lens = [19, 0, 5]
    slope = lightning_ref.lightning_slopes(2, 1, 4).to(device)
    q, k, v = (t.to(device) for t in random_qkv(sum(lens), 2, 16, 24, torch.float32, seed=3))
    init = (torch.randn(len(lens), 2, 16, 24) * 0.5).to(device)
    out, final = prefill(q, k, v, slope, cu(lens).to(device), init)
    slots, pool = pool_with(init, 8, index_dtype, seed=4)
    before = pool.clone()
    out_pool, returned = prefill(q, k, v, slope, cu(lens).to(device), pool, state_indices=slots)
    assert returned is None
    torch.testing.assert_close(out_pool, out, **tol)
    torch.testing.assert_close(pool[slots.long()], final, **tol)
    state = pool[slots.long()]
    for seed in (5, 6):
        q, k, v = (t.to(device).view(len(lens), 2, -1) for t in random_qkv(len(lens), 2, 16, 24, torch.float32,
                                                                           seed=seed))
        expected = decode(q, k, v, slope, state)
        got = decode(q, k, v, slope, pool, state_indices=slots)
        torch.testing.assert_close(got, expected, **tol)
        torch.testing.assert_close(pool[slots.long()], state, **tol)
    torch.testing.assert_close(others(pool, slots), others(before, slots), atol=0, rtol=0)


def test_state_indices_are_checked():
    q = torch.zeros(4, 2, 16)
    slope = torch.ones(2)
    for prefill, decode in ((lightning_ref.lightning_attention_prefill, lightning_ref.lightning_attention_decode),
                            (lightning_kernels.lightning_attention_prefill,
                             lightning_kernels.lightning_attention_decode)):
        with pytest.raises(ValueError, match="needs the state pool"):
            prefill(q, q, q, slope, cu([4]), None, 16, state_indices=torch.tensor([0]))
        with pytest.raises(ValueError, match="the fp32 pool"):
            prefill(q, q, q, slope, cu([4]), torch.zeros(3, 2, 16, 8), 16, state_indices=torch.tensor([2]))
        with pytest.raises(ValueError, match=r"state_indices must be int32/int64 \[B\] = \[4\]"):
            decode(q, q, q, slope, torch.zeros(6, 2, 16, 16), state_indices=torch.tensor([0, 1]))
