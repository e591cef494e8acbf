"""The attention kernels on real GPU architectures, checked without one.

- fp8 (e4m3fn) KV is decoded by integer ops (``kv_ops.fp8e4m3_to_float``), so the kernels never
  name an fp8 type that sm_80 lacks: the decode must equal torch's float8_e4m3fn -> float32 for
  all 256 bit patterns (run under the interpreter, or compiled on a GPU);
- ``check_target`` (the contract hook the engine plan calls on CUDA) refuses, when the config is
  loaded, what a GPU cannot build: bf16 before sm_80, GPUs before sm_80, head dims over 256; it
  accepts fp8 KV on an A100;
- the per-architecture launch tables: under ``target_capability((8, 0))`` and ``((9, 0))`` the
  wrappers launch the configurations each architecture's table gives (recorded, not run);
- the context bucketing: over context lengths from 1 to 2^20, the constexprs a decode launches
  with take a bounded number of values (each is one compilation while serving).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import triton
import triton.language as tl
from lmplug_attention import decode_ops, kv_ops
from lmplug_attention.attn_ops import arch_entry, bucket
from lmplug_attention.flash import decode_kernels as flash_decode_kernels
from lmplug_attention.flash import prefill_kernels as flash_prefill_kernels
from lmplug_attention.flash.backend import FlashAttention, FlashAttentionOptions
from lmplug_attention.mla import kernels as mla_kernels
from lmplug_attention.mla.backend import MLAAttention, MLAOptions
from lmplug_attention.paged import prefill_kernels as paged_prefill_kernels
from lmplug_attention.paged.backend import PagedAttention, PagedAttentionOptions
from lmplug_attention.sdpa import SdpaAttention

from lmplug.api import BackendOptions
from lmplug.config import EngineConfig, resolve
from lmplug.engine.architecture import model_config_of
from lmplug.engine.plan import make_plan
from lmplug.errors import ConfigError
from lmplug.kit.devices import target_capability
from lmplug.parallel import single as single_parallel

A100, H100 = (8, 0), (9, 0)


# -- fp8 e4m3fn decoded by integer ops ------------------------------------------------------------


@triton.jit
def _decode_fp8_kernel(src_ptr, dst_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst_ptr + offs, kv_ops.fp8e4m3_to_float(tl.load(src_ptr + offs)))


def test_fp8_bit_decode_is_torchs_conversion_for_all_256_patterns(kernel_device):
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(kernel_device)
    out = torch.empty(256, dtype=torch.float32, device=kernel_device)
    _decode_fp8_kernel[(1,)](bits, out, N=256)
    want = bits.view(torch.float8_e4m3fn).to(torch.float32)
    # bit for bit: signed zeros, subnormals (2^-9 .. 7 * 2^-9), 448, and NaN at S.1111.111
    torch.testing.assert_close(out.cpu(), want.cpu(), rtol=0, atol=0, equal_nan=True)
    out, want = out.cpu(), want.cpu()
    number = ~torch.isnan(want)  # a NaN's sign means nothing
    assert torch.equal(torch.signbit(out[number]), torch.signbit(want[number]))  # -0.0 included
    assert int(number.sum()) == 254


def test_fp8_caches_reach_the_kernels_as_bytes():
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 4, 1)
    k, v, _, strides, quant = kv_ops.quant_args(cache, cache, scale, scale)
    assert k.dtype == v.dtype == torch.uint8 and quant == kv_ops.QUANT_FP8
    assert k.data_ptr() == cache.data_ptr() and strides == scale.stride()
    int8 = cache.view(torch.int8)
    assert kv_ops.quant_args(int8, int8, scale, scale)[4] == kv_ops.QUANT_INT8
    assert kv_ops.quant_args(int8, int8, None, None)[4] == kv_ops.QUANT_NONE


# -- check_target: refused when the config is loaded ----------------------------------------------


TRITON_BACKENDS = [(FlashAttention, FlashAttentionOptions()), (PagedAttention, PagedAttentionOptions()),
                   (MLAAttention, MLAOptions())]


@pytest.mark.parametrize(("cls", "options"), TRITON_BACKENDS, ids=lambda x: getattr(x, "name", ""))
def test_bf16_before_sm80_is_refused_naming_key_backend_and_gpu(cls, options):
    with pytest.raises(ConfigError, match=rf"dtype: bfloat16 .*{cls.name!r}.*sm_75 \(compute capability 7.5\)"):
        cls.check_target(options, "auto", 128, "bfloat16", (7, 5))
    with pytest.raises(ConfigError, match=rf"attention.backend: {cls.name!r} .*8.0 and newer.*sm_75"):
        cls.check_target(options, "auto", 128, "float16", (7, 5))


@pytest.mark.parametrize(("cls", "options"), TRITON_BACKENDS[:2], ids=lambda x: getattr(x, "name", ""))
def test_head_dims_the_kernels_do_not_take_are_refused(cls, options):
    for cap in (A100, H100):
        for head_dim in (64, 80, 96, 128, 256):
            cls.check_target(options, "auto", head_dim, "bfloat16", cap)
        with pytest.raises(ConfigError, match=rf"{cls.name!r} .*head dims 1 to 256.*head_dim is 512.*sm_"):
            cls.check_target(options, "auto", 512, "float16", cap)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8", "auto"])
def test_quantized_kv_is_accepted_on_an_a100(kv_dtype):
    for cls, options in TRITON_BACKENDS[:2]:
        cls.check_target(options, kv_dtype, 128, "bfloat16", A100)
    MLAAttention.check_target(MLAOptions(), kv_dtype, 576, "bfloat16", A100)  # the latent row


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_float32_with_a_quantized_cache_is_refused_on_a_gpu(kv_dtype):
    """The exact-fp32 tiles plus the dequantize spill kilobytes per thread (make gpu-compile)."""
    for cls, options in TRITON_BACKENDS[:2]:
        for cap in (A100, H100):
            with pytest.raises(ConfigError, match=rf"kvcache.dtype: {kv_dtype!r} with dtype: float32 .*"
                                                  rf"{cls.name!r}.*sm_"):
                cls.check_target(options, kv_dtype, 128, "float32", cap)
        cls.check_target(options, "auto", 128, "float32", A100)
        cls.check_target(options, kv_dtype, 128, "float32", None)  # the interpreter, the CPU
    PagedAttention.check_target(PagedAttentionOptions(kernels="torch"), kv_dtype, 128, "float32", A100)


def test_pytorch_kernels_and_the_default_hook_check_nothing():
    PagedAttention.check_target(PagedAttentionOptions(kernels="torch"), "auto", 512, "bfloat16", (7, 0))
    MLAAttention.check_target(MLAOptions(kernels="torch"), "auto", 576, "bfloat16", (7, 0))
    SdpaAttention.check_target(BackendOptions(), "fp8_e4m3", 512, "bfloat16", (7, 0))


def _llama(head_dim: int) -> dict:
    return {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "vocab_size": 512,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6}


def _plan(device: str, dtype: str, head_dim: int, **sections):
    config = EngineConfig(model="tiny", device=device, dtype=dtype, **sections)
    resolved = resolve(config, device=device, dtype=dtype)
    hf = _llama(head_dim)
    return make_plan(resolved, hf, model_config_of(hf), "tiny", single_parallel())


def test_the_engine_plan_asks_the_hook_for_the_gpu_it_runs_on():
    sections = {"attention": {"backend": "paged"}, "kvcache": {"backend": "paged", "dtype": "fp8_e4m3"}}
    with target_capability((7, 5)), pytest.raises(ConfigError, match=r"dtype: bfloat16 .*'paged'.*sm_75"):
        _plan("cuda", "bfloat16", 16, **sections)
    with target_capability(A100):
        with pytest.raises(ConfigError, match=r"'paged' .*head_dim is 512.*sm_80"):
            _plan("cuda", "float16", 512, **sections)
        assert _plan("cuda", "bfloat16", 128, **sections).kv_shape["head_dim"] == 128
        # on CPU nothing is compiled for a GPU: not asked
        _plan("cpu", "float32", 512, attention={"backend": "paged"}, kvcache={"backend": "paged"})


# -- per-architecture launch tables ---------------------------------------------------------------


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: records each launch (grid, arguments), runs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, tuple, dict]] = []

    @property
    def launches(self) -> list[tuple[tuple, dict]]:
        return [(grid, kwargs) for grid, _, kwargs in self.calls]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def record(monkeypatch):
    def patch(module, name: str) -> Recorder:
        rec = Recorder()
        monkeypatch.setattr(module, name, rec)
        return rec
    return patch


def test_arch_entry_takes_the_newest_listed_architecture_not_newer():
    table = {None: "cpu", (8, 0): "a100", (9, 0): "h100"}
    assert [arch_entry(table, c) for c in (None, (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))] == \
        ["cpu", "a100", "a100", "a100", "a100", "h100", "h100", "h100"]


def _target(cap):
    """Launch as for ``cap``; None: as for CPU tensors (the interpreter's entry)."""
    return contextlib.nullcontext() if cap is None else target_capability(cap)


def _flash_prefill_launch(record, cap, head_dim, dtype=torch.float16, quant=False):
    rec = record(flash_prefill_kernels, "_flash_prefill_kernel")
    q = torch.zeros(8, 4, head_dim, dtype=dtype)
    cache = torch.zeros(4, 16, 2, head_dim, dtype=torch.int8 if quant else dtype)
    scales = {"k_scale": torch.ones(4, 16, 2), "v_scale": torch.ones(4, 16, 2)} if quant else {}
    with _target(cap):
        flash_prefill_kernels.flash_prefill_with_kvcache(
            q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([40], dtype=torch.int32), 0.1, max_query_len=8, **scales)
    (_, kw), = rec.launches
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_flash_prefill_takes_64_query_rows_on_sm80_and_128_on_sm90(record, head_dim):
    # every BLOCK_M=128 tile spills on sm_80; sm_90 holds it (up to d128)
    a100 = _flash_prefill_launch(record, A100, head_dim)
    h100 = _flash_prefill_launch(record, H100, head_dim)
    assert a100[0] == 64 and h100[0] == 128
    assert _flash_prefill_launch(record, A100, head_dim, quant=True) == a100  # quantized KV: the same entry
    assert _flash_prefill_launch(record, (8, 9), head_dim) == a100  # Ada takes the sm_80 entry


def test_flash_prefill_tables_keep_fp32_exact_sized_tiles(record):
    """Exact fp32 dots hold their operands in registers: smaller tiles than 16-bit, and on sm_90
    smaller still (its layout of the sm_80 tile spills 2.4-4.3 KB per thread, make gpu-compile)."""
    for cap in (None, A100):
        assert _flash_prefill_launch(record, cap, 128, torch.float32)[:2] == (64, 32)
        assert _flash_prefill_launch(record, cap, 256, torch.float32)[:2] == (32, 32)
    assert _flash_prefill_launch(record, H100, 128, torch.float32)[:2] == (32, 16)
    assert _flash_prefill_launch(record, H100, 256, torch.float32)[:2] == (16, 16)
    for cap in (A100, H100):
        for head_dim in (64, 128, 256):
            fp32 = _flash_prefill_launch(record, cap, head_dim, torch.float32)
            half = _flash_prefill_launch(record, cap, head_dim, torch.float16)
            assert fp32[0] * fp32[1] <= half[0] * half[1]


def _paged_prefill_launch(record, cap, head_dim, num_heads=8, num_kv_heads=2):
    rec = record(paged_prefill_kernels, "_paged_prefill_kernel")
    q = torch.zeros(8, num_heads, head_dim, dtype=torch.float16)
    cache = torch.zeros(4, 16, num_kv_heads, head_dim, dtype=torch.float16)
    with target_capability(cap):
        paged_prefill_kernels.paged_prefill_attention(
            q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([40], dtype=torch.int32), 0.1, max_query_len=8)
    (_, kw), = rec.launches
    return kw["BLOCK_Q"] * kw["G_PAD"], kw["TILE"], kw["num_warps"], kw["num_stages"]


def test_paged_prefill_tables_differ_where_a_config_spills(record):
    # d256: 64 x 64 spills and takes 160 KiB of shared memory on sm_90: both take 32-key tiles,
    # 8 warps, two stages
    for cap in (A100, H100):
        assert _paged_prefill_launch(record, cap, 256) == (64, 32, 8, 2)
    # d64 (fp8 KV) and d128: the 64 x 64 tile spills on sm_80 only
    for head_dim in (64, 128):
        assert _paged_prefill_launch(record, A100, head_dim) == (64, 32, 4, 3)
        assert _paged_prefill_launch(record, H100, head_dim) == (64, 64, 4, 3)
    # GQA groups of 8: 8 tokens x 8 heads per program, the same 64 rows
    assert _paged_prefill_launch(record, H100, 128, num_heads=16) == (64, 64, 4, 3)


def test_split_k_plans_for_the_sm_count_of_the_target(record):
    """MLA decode at 13 sequences x 1 head tile: fills 108 SMs on sm_80, 132 on sm_90."""
    rec = record(mla_kernels, "_mla_decode_kernel")
    record(decode_ops, "_decode_reduce_kernel")
    q = torch.zeros(13, 16, 80)
    cache = torch.zeros(4, 16, 1, 80)
    grids = {}
    for cap in (A100, H100):
        with target_capability(cap):
            mla_kernels.mla_decode_latent(q, cache, torch.zeros(13, 4, dtype=torch.int32),
                                          torch.full((13,), 8192, dtype=torch.int32), 0.1, 64,
                                          max_seq_len=8192)
        grids[cap] = rec.launches[-1][0]
    assert grids[A100] == (13, 1, math.ceil(2 * 108 / 13))
    assert grids[H100] == (13, 1, math.ceil(2 * 132 / 13))


# -- context bucketing: a bounded number of compilations -------------------------------------------


CONTEXTS = sorted({1, 2, 15, 16, 17, 255, 256, 257, 511, 512, 513, 1000, 4096, 5000, 65537, 2**20}
                  | {int(1.37 ** i) for i in range(45)})


def _variants(launches, names):
    return {tuple(kw[n] for n in names) for _, kw in launches}


def test_flash_decode_compiles_a_bounded_number_of_variants_over_context_lengths(record):
    dec = record(decode_ops, "_decode_kernel")
    red = record(decode_ops, "_decode_reduce_kernel")
    for head_dim in (128, 256):
        q = torch.zeros(1, 8, head_dim, dtype=torch.float16)
        cache = torch.zeros(4, 16, 1, head_dim, dtype=torch.float16)
        for context in CONTEXTS:
            flash_decode_kernels.flash_decode_with_kvcache(
                q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([context], dtype=torch.int32),
                0.1, max_seq_len=context)
    assert _variants(dec.launches, ["D_PAD", "SPLIT"]) == {(d, s) for d in (128, 256) for s in (False, True)}
    # S_TILE: a power of two, capped so the reduce's [S_TILE, D_PAD] fp32 tile stays 8192 values
    assert _variants(red.launches, ["D_PAD", "S_TILE"]) == \
        {(128, t) for t in (2, 4, 8, 16, 32, 64)} | {(256, t) for t in (2, 4, 8, 16, 32)}
    # the partition size (argument 14) is a runtime int, which Triton specializes only on
    # divisibility by 16: it always is
    assert {args[14] % 16 for _, args, _ in dec.calls} == {0}


def test_mla_decode_compiles_a_bounded_number_of_variants_over_context_lengths(record):
    dec = record(mla_kernels, "_mla_decode_kernel")
    red = record(decode_ops, "_decode_reduce_kernel")
    q = torch.zeros(1, 16, 576, dtype=torch.float16)
    cache = torch.zeros(4, 16, 1, 576, dtype=torch.float16)
    for cap in (A100, H100):
        with target_capability(cap):
            for context in CONTEXTS:
                mla_kernels.mla_decode_latent(q, cache, torch.zeros(1, 4, dtype=torch.int32),
                                              torch.tensor([context], dtype=torch.int32), 0.1, 512,
                                              max_seq_len=context)
    assert _variants(dec.launches, ["SPLIT"]) == {(False,), (True,)}
    assert _variants(red.launches, ["S_TILE"]) == {(2,), (4,), (8,), (16,)}  # capped at R = 512


def test_bucket_is_a_power_of_two_within_its_bounds():
    assert [bucket(n, 2, 16) for n in (0, 1, 2, 3, 5, 9, 16, 17, 1000)] == [2, 2, 2, 4, 8, 16, 16, 16, 16]
