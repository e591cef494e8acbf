"""KV-cache quantization (kvcache ``dtype: int8 | fp8_e4m3``): storage, every attention backend
that claims it, the KV backends, and config resolution.

- quantize -> dequantize round trip within the format's bound (int8: amax / 254 per element;
  e4m3: 2^-4 relative, plus half the subnormal step near zero);
- each attention backend (sdpa, paged with the PyTorch ops and the Triton kernels, flash)
  over a quantized view equals, exactly, the same backend over the dequantized K/V (the
  kernels dequantize in the reference's op order), and stays within a bound derived from the
  quantization error of the unquantized run; the Triton backends run on ``kernel_device`` (the CPU
  under TRITON_INTERPRET=1, or compiled on a CUDA GPU; fp8 there needs sm_89+);
- bytes_per_token, scales in the data layout, copy-on-write, and config errors.

The engine with a quantized KV cache: test_kv_quant_engine.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from lmplug_attention import decode_ref, kv_ref
from lmplug_attention.flash.backend import FlashAttention, FlashAttentionOptions
from lmplug_attention.paged import torch_path as paged_torch
from lmplug_attention.paged.backend import PagedAttention, PagedAttentionOptions
from lmplug_attention.paged.rows import leading_short_queries, query_rows
from lmplug_attention.sdpa import SdpaAttention
from lmplug_kvcache.contiguous import ContiguousKVCache, ContiguousOptions
from lmplug_kvcache.paged import PagedKVCache, PagedOptions
from support.hf_models import one_torch_thread  # noqa: F401 - fixture

from lmplug.api import BackendOptions, KVCacheSpec, KVLayerView
from lmplug.config import EngineConfig, resolve
from lmplug.errors import ConfigError
from lmplug.interfaces.kvcache import KV_CACHE_DTYPES
from lmplug.kit.kv_quant import dequantize_kv, quantize_kv, store_kv
from lmplug.testing.attention_case import build_case
from lmplug.testing.batches import BatchSpec

KV_DTYPES = list(KV_CACHE_DTYPES)  # int8, fp8_e4m3
INT8, FP8 = torch.int8, torch.float8_e4m3fn
# e4m3: 3 mantissa bits -> round-to-nearest relative error <= 2^-4 for normals (|y| >= 2^-6);
# below, subnormals are spaced 2^-9 apart: absolute error <= 2^-10 (in units of the scale)
FP8_REL, FP8_SUBNORMAL_ABS = 2.0**-4, 2.0**-10


def vector_error_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-element bound on |dequantize(quantize(x)) - x| for vectors x [..., D]."""
    amax = x.float().abs().amax(-1, keepdim=True)
    if dtype == INT8:
        return (amax / 254).expand_as(x)
    return FP8_REL * x.float().abs() + FP8_SUBNORMAL_ABS * amax / 448


# -- round trip -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bound(kv_dtype, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 64, generator=g)
    # magnitudes over many decades, a row of tiny values next to an outlier, an all-zero vector
    x = x * torch.logspace(-4, 3, 64)[:, None, None]
    x[3, 1, 7] = 500.0
    x[5, 2] = 0.0
    x = x.to(dtype)
    storage = KV_CACHE_DTYPES[kv_dtype]
    q, scale = quantize_kv(x, storage)
    assert q.dtype == storage and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert torch.equal(scale, x.float().abs().amax(-1) / (127 if storage == INT8 else 448))
    assert scale[5, 2] == 0 and not dequantize_kv(q, scale, dtype)[5, 2].any()
    back = dequantize_kv(q, scale, torch.float32)
    err = (back - x.float()).abs()
    # float32 slack: q * scale and the difference round, by a few ulps of the vector's amax
    slack = 1e-6 * x.float().abs().amax(-1, keepdim=True)
    assert (err <= vector_error_bound(x, storage) + slack).all()
    # the bound is tight enough to mean something: the worst case comes close to it
    assert (err / vector_error_bound(x, storage).clamp_min(1e-30)).max() > 0.5


def test_int8_rounds_to_nearest_and_saturates_symmetrically():
    x = torch.tensor([[-254.0, -1.0, 0.0, 0.5, 1.5, 254.0]])
    q, scale = quantize_kv(x, INT8)
    assert scale.item() == 2.0
    assert q.tolist() == [[-127, 0, 0, 0, 1, 127]]  # half to even, as torch.round


def test_store_kv_writes_data_and_scales_at_the_slots():
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(4, 8, 2, 16, dtype=FP8)
    scales = torch.full((4, 8, 2), float("nan"))
    x = torch.randn(3, 2, 16, generator=g)
    slots = torch.tensor([31, 0, 9])
    store_kv(cache, scales, x, slots)
    q, s = quantize_kv(x, FP8)
    flat, flat_s = cache.view(-1, 2, 16), scales.view(-1, 2)
    assert torch.equal(flat[slots].float(), q.float()) and torch.equal(flat_s[slots], s)
    assert flat_s.isnan().sum() == (32 - 3) * 2  # nothing else written


# -- attention backends ---------------------------------------------------------------------------

SPECS = {
    # decodes, a chunked prefill and a fresh prompt in one step (GQA 4:2)
    "mixed": BatchSpec("mixed", query_lens=(1, 1, 5, 9), context_lens=(20, 7, 11, 0), num_heads=4,
                       num_kv_heads=2, head_dim=32, block_size=8),
    # sliding window, MQA
    "window": BatchSpec("window", query_lens=(1, 6), context_lens=(30, 12), num_heads=4,
                        num_kv_heads=1, head_dim=32, block_size=8, sliding_window=10),
    # fresh prompts only (flash reads the step's own, unquantized K/V for them)
    "fresh": BatchSpec("fresh", query_lens=(1, 7, 12), context_lens=(25, 0, 0), num_heads=4,
                       num_kv_heads=2, head_dim=32, block_size=8),
}
BACKENDS = {
    "sdpa-contiguous": (SdpaAttention, BackendOptions(), "contiguous"),
    "sdpa-paged": (SdpaAttention, BackendOptions(), "paged"),
    "paged-torch": (PagedAttention, PagedAttentionOptions(kernels="torch"), "paged"),
    "paged-triton": (PagedAttention, PagedAttentionOptions(kernels="triton"), "paged"),
    "paged-triton-splitk": (PagedAttention, PagedAttentionOptions(kernels="triton", partition_size=16),
                            "paged"),
    "flash-paged": (FlashAttention, FlashAttentionOptions(), "paged"),
    "flash-contiguous-split": (FlashAttention, FlashAttentionOptions(num_splits=2), "contiguous"),
}


TRITON_BACKENDS = {"paged-triton", "paged-triton-splitk", "flash-paged", "flash-contiguous-split"}


def device_for(name: str, kernel_device: str) -> str:
    """The Triton backends run on the kernel device (an fp8 cache too, on any GPU: the kernels decode
    its bytes by integer ops, and the write is PyTorch's); the PyTorch ones on the CPU."""
    if name not in TRITON_BACKENDS:
        return "cpu"
    return kernel_device


def make_backend(name: str, spec: BatchSpec):
    cls, options, _ = BACKENDS[name]
    return cls(options, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
               head_dim=spec.head_dim, scale=spec.head_dim ** -0.5, sliding_window=spec.sliding_window)


def quantized_view(view: KVLayerView, storage: torch.dtype) -> KVLayerView:
    """The same cache quantized; poisoned (NaN) slots get NaN scales, so reading one still shows."""
    kq, ks = quantize_kv(view.k_cache, storage)
    vq, vs = quantize_kv(view.v_cache, storage)
    return KVLayerView(kq, vq, view.layout, ks, vs)


def dequantized_view(view: KVLayerView, dtype: torch.dtype) -> KVLayerView:
    return KVLayerView(dequantize_kv(view.k_cache, view.k_scale, dtype),
                       dequantize_kv(view.v_cache, view.v_scale, dtype), view.layout)


def round_trip(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    return dequantize_kv(*quantize_kv(x, storage), x.dtype)


def output_bound(case, storage: torch.dtype) -> float:
    """|o_quant - o| when every score moves by at most d = scale * max ||q_h||_1 * max |dk| and
    every value by at most max |dv|: each softmax weight moves by a factor within e^(+-2d), so
    |do| <= (e^(2d) - 1) * max |v| + max |dv|."""
    keys, values = torch.cat(case.keys), torch.cat(case.values)
    dk = vector_error_bound(keys, storage).max().item()
    dv = vector_error_bound(values, storage).max().item()
    d = case.spec.head_dim ** -0.5 * case.q.float().abs().sum(-1).max().item() * dk
    return math.expm1(2 * d) * values.float().abs().max().item() + dv


def reference_forward(att, q, k, v, view: KVLayerView, ctx) -> torch.Tensor:
    """``att.forward`` over an unquantized view; for the torch ``paged`` ops, those ops themselves
    (``kv_ref``, ``decode_ref``, ``paged_torch``: the backend may take a faster CPU decode path
    for unquantized caches)."""
    if not (isinstance(att, PagedAttention) and att.options.kernels == "torch"):
        return att.forward(0, q, k, v, view, ctx)
    kv_ref.reshape_and_cache(k, v, view.k_cache, view.v_cache, ctx.slot_mapping)
    out = torch.empty_like(q)
    rows = query_rows(ctx, leading_short_queries(ctx))  # on CPU short queries are decode rows
    m, t = rows.num_seqs, rows.num_tokens
    if t:
        decode_ref.decode_attention(q[:t], view.k_cache, view.v_cache, rows.block_tables,
                                    rows.seq_lens, att.scale, sliding_window=att.sliding_window,
                                    out=out[:t])
    if m < ctx.num_seqs:
        paged_torch.paged_prefill_attention(q[t:], view.k_cache, view.v_cache, ctx.block_tables[m:],
                                            ctx.cu_query_lens[m:] - t, ctx.seq_lens[m:], att.scale,
                                            sliding_window=att.sliding_window, out=out[t:])
    return out


def fresh_prefill_rows(case) -> torch.Tensor:
    """Rows flash computes from the step's packed K/V: prefills, when none has a cached prefix."""
    rows = torch.zeros(case.q.shape[0], dtype=torch.bool, device=case.q.device)
    spec = case.spec
    if all(c == 0 for c in spec.context_lens[spec.num_decodes:]):
        rows[sum(spec.query_lens[:spec.num_decodes]):] = True
    return rows


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_reads_quantized_kv(backend, spec_name, kv_dtype, kernel_device):
    spec, storage, dtype = SPECS[spec_name], KV_CACHE_DTYPES[kv_dtype], torch.float32
    case = build_case(spec, BACKENDS[backend][2], dtype, device_for(backend, kernel_device))
    att = make_backend(backend, spec)
    ref_view = KVLayerView(case.view.k_cache.clone(), case.view.v_cache.clone(), case.layout)
    expected = att.forward(spec.layer, case.q, case.k, case.v, ref_view, case.ctx)

    view = quantized_view(case.view, storage)
    dq_view = dequantized_view(view, dtype)  # before the step's write
    out = att.forward(spec.layer, case.q, case.k, case.v, view, case.ctx)
    assert out.dtype == dtype and not out.isnan().any()

    # the write quantized the step's K/V into their slots, scales alongside
    slots = case.ctx.slot_mapping
    written = dequantize_kv(view.k_cache.view(-1, *case.k.shape[1:])[slots],
                            view.k_scale.view(-1, case.k.shape[1])[slots], dtype)
    assert torch.equal(written, round_trip(case.k, storage))

    # exactly the backend's reference over the dequantized cache, given the dequantized new K/V
    same = reference_forward(att, case.q, round_trip(case.k, storage), round_trip(case.v, storage),
                             dq_view, case.ctx)
    raw = fresh_prefill_rows(case) if isinstance(att, FlashAttention) else torch.zeros_like(
        fresh_prefill_rows(case))
    assert torch.equal(out[~raw], same[~raw])
    assert torch.equal(out[raw], expected[raw])  # flash: a fresh prompt never meets quantized K/V

    # and close to the unquantized run, within the bound the quantization error implies
    bound = output_bound(case, storage)
    err = (out - expected).abs().max().item()
    assert err <= bound + 1e-5, (err, bound)
    assert err > 0  # the quantized path ran


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", ["paged-triton", "paged-triton-splitk", "flash-paged"])
def test_kernels_match_the_torch_reference_on_quantized_kv(backend, kv_dtype, kernel_device):
    spec, storage = SPECS["mixed"], KV_CACHE_DTYPES[kv_dtype]
    case = build_case(spec, "paged", torch.float32, device_for(backend, kernel_device))
    outs = []
    for name in ("paged-torch", backend):
        view = quantized_view(case.view, storage)
        outs.append(make_backend(name, spec).forward(spec.layer, case.q, case.k, case.v, view, case.ctx))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["sdpa-paged", "paged-torch", "paged-triton", "flash-paged"])
def test_fp16_model_with_quantized_kv(backend, kernel_device):
    """fp16 activations: tiles are dequantized to fp16 before the dot, as the reference does."""
    spec, dtype = SPECS["mixed"], torch.float16
    case = build_case(spec, "paged", dtype, device_for(backend, kernel_device))
    att = make_backend(backend, spec)
    view = quantized_view(case.view, INT8)
    dq_view = dequantized_view(view, dtype)
    out = att.forward(spec.layer, case.q, case.k, case.v, view, case.ctx)
    same = reference_forward(att, case.q, round_trip(case.k, INT8), round_trip(case.v, INT8),
                             dq_view, case.ctx)
    assert out.dtype == dtype
    assert torch.equal(out, same)


def test_kernels_reject_mismatched_scales():
    from lmplug_attention.paged import kernels as paged_kernels

    case = build_case(SPECS["mixed"], "paged", torch.float32, "cpu")
    view = quantized_view(case.view, INT8)
    args = (case.q[:2], view.k_cache, view.v_cache, case.ctx.block_tables[:2], case.ctx.seq_lens[:2], 0.1)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_kernels.paged_decode_attention(*args, k_scale=view.k_scale[:, :4], v_scale=view.v_scale)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        paged_kernels.paged_decode_attention(*args, k_scale=view.k_scale)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_kernels.paged_decode_attention(*args)  # int8 caches without scales


# -- KV backends ----------------------------------------------------------------------------------


def spec_of(dtype: torch.dtype, **kw) -> KVCacheSpec:
    return KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype=dtype, device=torch.device("cpu"),
                       max_model_len=64, max_num_seqs=2, **kw)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_bytes_per_token_counts_data_and_scales(kv_dtype):
    fp16, fp32 = spec_of(torch.float16), spec_of(torch.float32)
    quant = spec_of(torch.float16, kv_dtype=kv_dtype)
    assert fp16.bytes_per_token == 2 * 3 * 2 * 64 * 2
    # one byte per value (half of fp16, a quarter of fp32) plus a 4-byte scale per (token, head)
    assert quant.bytes_per_token == fp16.bytes_per_token // 2 + 2 * 3 * 2 * 4
    assert quant.bytes_per_token == fp32.bytes_per_token // 4 + 2 * 3 * 2 * 4
    assert spec_of(torch.float32, kv_dtype=kv_dtype).bytes_per_token == quant.bytes_per_token
    # the pool holds that many more tokens in the same memory
    gb = 2**20 / 2**30
    plain = PagedKVCache(PagedOptions(memory_gb=gb), spec_of(torch.float16))
    small = PagedKVCache(PagedOptions(memory_gb=gb, dtype=kv_dtype), spec_of(torch.float16))
    assert small.num_tokens / plain.num_tokens == pytest.approx(2 * 64 / 68, rel=0.02)
    assert small.memory_bytes <= 2**20 and small.bytes_per_token == quant.bytes_per_token


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_kv_backends_allocate_scales_in_the_data_layout(kv_dtype):
    storage = KV_CACHE_DTYPES[kv_dtype]
    paged = PagedKVCache(PagedOptions(num_blocks=5, block_size=4, dtype=kv_dtype), spec_of(torch.float32))
    contiguous = ContiguousKVCache(ContiguousOptions(dtype=kv_dtype), spec_of(torch.float32))
    for kv, shape in ((paged, (5, 4, 2)), (contiguous, (2, 64, 2))):
        for layer in range(3):
            view = kv.layer_view(layer)
            assert view.quantized and view.k_cache.dtype == view.v_cache.dtype == storage
            assert view.k_cache.shape == (*shape, 64)
            assert view.k_scale.shape == view.v_scale.shape == shape
            assert view.k_scale.dtype == torch.float32
        assert kv.spec.kv_dtype == kv_dtype and kv.spec.dtype == torch.float32
    assert not PagedKVCache(PagedOptions(num_blocks=5), spec_of(torch.float32)).layer_view(0).quantized


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_copy_on_write_copies_scales(kv_dtype):
    kv = PagedKVCache(PagedOptions(num_blocks=6, block_size=4, dtype=kv_dtype), spec_of(torch.float32))
    g = torch.Generator().manual_seed(0)
    for layer in range(3):
        view = kv.layer_view(layer)
        slots = torch.arange(8, 12)  # block 2
        store_kv(view.k_cache, view.k_scale, torch.randn(4, 2, 64, generator=g), slots)
        store_kv(view.v_cache, view.v_scale, torch.randn(4, 2, 64, generator=g), slots)
    kv._copy_blocks([(2, 5)])
    for layer in range(3):
        view = kv.layer_view(layer)
        for data, scale in ((view.k_cache, view.k_scale), (view.v_cache, view.v_scale)):
            assert torch.equal(data[5].view(torch.uint8), data[2].view(torch.uint8))
            assert torch.equal(scale[5], scale[2]) and scale[5].gt(0).all()


def test_latent_cache_refuses_quantization():
    with pytest.raises(ConfigError, match="MLA latent"):
        PagedKVCache(PagedOptions(num_blocks=4, dtype="int8"), spec_of(torch.float32, latent=True))


# -- config ---------------------------------------------------------------------------------------


def resolved(**sections):
    return resolve(EngineConfig(model="x", **sections), device="cpu", dtype="float32")


def test_auto_attention_picks_a_backend_that_reads_the_kv_dtype(monkeypatch):
    from lmplug.api import Capabilities

    assert resolved(kvcache={"backend": "paged", "dtype": "int8"}).backends["attention"].name == "paged"
    # a paged attention that does not read int8: auto falls back to sdpa, which does
    caps = PagedAttention.capabilities
    monkeypatch.setattr(PagedAttention, "capabilities", Capabilities(
        devices=caps.devices, kv_layouts=caps.kv_layouts, features=caps.features, priority=caps.priority))
    assert resolved(kvcache={"backend": "paged", "dtype": "int8"}).backends["attention"].name == "sdpa"
    assert resolved(kvcache={"backend": "paged"}).backends["attention"].name == "paged"
    with pytest.raises(ConfigError, match=r"kvcache.dtype='fp8_e4m3'.*'paged'"):
        resolved(kvcache={"backend": "paged", "dtype": "fp8_e4m3"}, attention="paged")


def test_attention_that_cannot_read_it_is_refused():
    with pytest.raises(ConfigError, match=r"kvcache.dtype='int8' is not read by attention backend 'mla'"):
        resolved(kvcache={"backend": "paged", "dtype": "int8"}, attention="mla")
    with pytest.raises(ConfigError, match=r"kvcache.dtype"):
        resolved(kvcache={"backend": "paged", "dtype": "int4"})
