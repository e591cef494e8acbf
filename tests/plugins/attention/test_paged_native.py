"""The native C decode kernel of attention `paged` (paged_native.py, csrc/paged_decode_cpu.c)
against the PyTorch reference (decode_ref) and float64 math, and its option ``cpu_kernel``
in the engine: same greedy tokens as the PyTorch path, a fallback or a ConfigError when
it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
from lmplug_attention.decode_ref import decode_attention
from lmplug_attention.paged import backend as paged_backend
from lmplug_attention.paged import native as paged_native
from support.paged_cases import float64_attention, paged_batch

from lmplug import LLM, SamplingParams
from lmplug.errors import ConfigError

LENS = [1, 300, 7, 16, 2, 33, 129, 64, 255, 17]  # mixed in one batch, from one slot to a few hundred


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (4, 1)],
                         ids=["mha", "gqa9-3", "gqa8-2", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40])  # 40: not a multiple of 16 (no AVX-512 path)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 37])
def test_matches_reference_fp32(native, num_heads, num_kv_heads, head_dim, block_size, window):
    q, kc, vc, tables, lens = paged_batch(LENS, num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    scale = head_dim ** -0.5
    ref = decode_attention(q, kc, vc, tables, lens, scale, sliding_window=window)
    out = torch.empty_like(q)
    got = native.paged_decode_attention(q, kc, vc, tables, lens, scale, sliding_window=window, out=out)
    assert got is out
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,ulp,atol", [(torch.bfloat16, 2.0 ** -8, 1e-2), (torch.float16, 2.0 ** -11, 2e-3)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 80), (6, 2, 40)])
@pytest.mark.parametrize("window", [None, 100])
def test_half_precision_against_reference_and_float64(native, dtype, ulp, atol, num_heads, num_kv_heads,
                                                      head_dim, window):
    if dtype not in native.supported_dtypes():
        pytest.skip(f"this compiler has no kernel for {dtype}")
    q, kc, vc, tables, lens = paged_batch(LENS, num_heads, num_kv_heads, head_dim, 16, dtype, seed=2)
    scale = head_dim ** -0.5
    got = native.paged_decode_attention(q, kc, vc, tables, lens, scale, sliding_window=window)
    assert got.dtype == dtype
    ref = decode_attention(q, kc, vc, tables, lens, scale, sliding_window=window)
    # the reference attends in the storage dtype (probabilities rounded too): near-zero outputs
    # differ by more than the default atol
    torch.testing.assert_close(got, ref, atol=atol, rtol=8 * ulp)
    # float32 math and one rounding of the output: within half an ulp (+ float32 noise) of the exact
    # result, and never further from it than the reference is (+ one ulp)
    exact = float64_attention(q, kc, vc, tables, lens, scale, window)
    err = (got.double() - exact).abs()
    assert (err <= ulp * exact.abs() + 1e-5).all(), float(err.max())
    ref_err = (ref.double() - exact).abs()
    assert (err <= ref_err + 2 * ulp * exact.abs() + 1e-5).all()


def test_bf16_output_rounds_to_nearest_even_like_torch(native):
    """q = 0: every weight is exactly 1, so the output is the float32 sum of the V rows (exact for
    a few bf16 values) times float32 1/len, rounded once to bf16: bit for bit torch's rounding."""
    lens = [3, 5, 6, 7]
    _, kc, vc, tables, seq_lens = paged_batch(lens, 4, 2, 64, 4, torch.bfloat16, seed=5)
    q = torch.zeros(len(lens), 4, 64, dtype=torch.bfloat16)
    got = native.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.1)
    rounded = 0
    for i, n in enumerate(lens):
        slots = [int(tables[i, p // 4]) * 4 + p % 4 for p in range(n)]
        mean = vc.reshape(-1, 2, 64)[slots].float().sum(0) * (torch.tensor(1.0) / n)  # [Hkv, D]
        assert torch.equal(got[i], mean.bfloat16().repeat_interleave(2, dim=0))
        rounded += int((mean.bfloat16().float() != mean).sum())
    assert rounded > 100  # most outputs needed rounding, so the rule shows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_never_reads_unused_slots(native, dtype, block_size):
    """NaN in every slot no sequence attends to changes nothing: the output is finite and equal."""
    args = LENS, 9, 3, 64, block_size, dtype
    q, kc, vc, tables, lens = paged_batch(*args, seed=7)
    _, kc_nan, vc_nan, _, _ = paged_batch(*args, seed=7, poison=True)
    assert kc_nan.isnan().any() and vc_nan.isnan().any()
    for window in (None, 5):
        clean = native.paged_decode_attention(q, kc, vc, tables, lens, 0.125, sliding_window=window)
        poisoned = native.paged_decode_attention(q, kc_nan, vc_nan, tables, lens, 0.125, sliding_window=window)
        assert torch.isfinite(poisoned).all()
        assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("window", [1, 16, 299, 10_000])
def test_sliding_window_edges(native, window):
    q, kc, vc, tables, lens = paged_batch(LENS, 8, 2, 64, 4, torch.float32, seed=3)
    got = native.paged_decode_attention(q, kc, vc, tables, lens, 0.125, sliding_window=window)
    exact = float64_attention(q, kc, vc, tables, lens, 0.125, window)
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 1000])  # 1000: more threads than the 30 tasks
def test_threads_give_the_same_result(native, threads):
    q, kc, vc, tables, lens = paged_batch(LENS, 9, 3, 64, 16, torch.bfloat16, seed=4)
    one = native.paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_threads=1)
    many = native.paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_threads=threads)
    assert torch.equal(one, many)  # each (sequence, KV head) task runs the same code on one thread
    torch.testing.assert_close(many, decode_attention(q, kc, vc, tables, lens, 0.125), atol=1e-2,
                               rtol=3e-2)


def test_strided_query_and_output(native):
    q, kc, vc, tables, lens = paged_batch(LENS, 4, 2, 64, 16, torch.float32, seed=6)
    wide = torch.zeros(len(LENS), 4, 128)
    wide[..., :64] = q
    out = torch.zeros(len(LENS), 4, 128)[..., 64:]
    got = native.paged_decode_attention(wide[..., :64], kc, vc, tables, lens, 0.125, out=out)
    assert got is out
    torch.testing.assert_close(out, decode_attention(q, kc, vc, tables, lens, 0.125), atol=1e-5,
                               rtol=1e-5)


def test_bad_inputs_are_clear_errors(native):
    q, kc, vc, tables, lens = paged_batch([5, 20], 4, 2, 64, 16, torch.float32)
    call = native.paged_decode_attention
    with pytest.raises(ValueError, match="quantized"):
        call(q, kc.to(torch.int8), vc.to(torch.int8), tables, lens, 0.1, k_scale=kc[..., 0], v_scale=vc[..., 0])
    with pytest.raises(ValueError, match="one dtype"):
        call(q.bfloat16(), kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        call(q[..., :32], kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="multiple of"):
        call(q[:, :3], kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="outside"):
        call(q, kc, vc, torch.full_like(tables, kc.shape[0]), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        call(q, kc, vc, tables[:, :1], lens, 0.1)  # 20 tokens need 2 blocks
    with pytest.raises(ValueError, match="contiguous"):
        call(q, kc.transpose(0, 1).contiguous().transpose(0, 1), vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="no kernel for torch.float64"):
        call(q.double(), kc.double(), vc.double(), tables, lens, 0.1)


# --- the option in the engine ------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def demo_like_llama(tmp_path_factory):
    """The demo model's attention shape (9 query heads over 3 KV heads), tiny."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=144, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("demo_like_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def paged_llm(path: str, cpu_kernel: str, dtype: str = "float32", cpu_rows: str = "all") -> LLM:
    return LLM(path, device="cpu", dtype=dtype, max_model_len=512,
               attention={"backend": "paged", "cpu_kernel": cpu_kernel, "cpu_rows": cpu_rows},
               kvcache={"backend": "paged", "block_size": 16, "num_blocks": 128})


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("cpu_rows", ["short", "all"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_native_gives_the_torch_tokens(native, demo_like_llama, monkeypatch, dtype, cpu_rows):
    batch = prompts(3, 40, 17, 90, 5, 130)
    expected = [o.outputs[0].token_ids for o in paged_llm(demo_like_llama, "torch", dtype).generate(batch, GREEDY)]
    calls = []
    decode = native.NativeKernel.decode
    monkeypatch.setattr(native.NativeKernel, "decode",
                        lambda self, q, *a, **k: calls.append(q.shape[0]) or decode(self, q, *a, **k))
    llm = paged_llm(demo_like_llama, "native", dtype, cpu_rows)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)] == expected
    assert len(batch) in calls  # the decode steps of the whole batch ran the C kernel
    # and the first step's short prompts (short) or every prompt (all), one row per token (paged_rows)
    assert max(calls) == (3 + 17 + 5 if cpu_rows == "short" else sum(map(len, batch)))


def test_native_that_cannot_build_fails_at_load(demo_like_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("LMPLUG_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    assert paged_native.available()[0] is False
    with pytest.raises(ConfigError, match=r"attention\.cpu_kernel='native'.*no C compiler"):
        paged_llm(demo_like_llama, "native")


def test_compile_error_is_reported_with_its_output(monkeypatch, tmp_path):
    cc = tmp_path / "broken-cc"
    cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo broken-cc 1.0; exit 0; fi\n'
                  'echo "paged_decode_cpu.c:1: error: no such luck" >&2; exit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("LMPLUG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    ok, why = paged_native.available()
    assert not ok and "exited with 1" in why and "no such luck" in why
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []  # no half-written library left


def test_auto_falls_back_to_torch_with_one_warning(demo_like_llama, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LMPLUG_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(paged_backend, "_warned", set())
    batch = prompts(9, 33)
    with caplog.at_level(logging.WARNING, logger="lmplug_attention.paged.backend"):
        got = paged_llm(demo_like_llama, "auto").generate(batch, GREEDY)
        again = paged_llm(demo_like_llama, "auto").generate(batch, GREEDY)
    warnings = [r.getMessage() for r in caplog.records if "native CPU decode kernel" in r.getMessage()]
    assert len(warnings) == 1 and "no C compiler" in warnings[0], warnings
    want = paged_llm(demo_like_llama, "torch").generate(batch, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]


def test_build_is_cached_per_source_compiler_and_cpu(native, monkeypatch, tmp_path):
    monkeypatch.setenv("LMPLUG_CACHE", str(tmp_path))
    ok, path = native.available()
    assert ok and path.startswith(str(tmp_path / "kernels" / "paged_decode_cpu-")) and path.endswith(".so")
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [path.rsplit("/", 1)[1]]
    assert native.available() == (True, path)  # loaded once, not rebuilt


# --- the native decode step's attention (lmplug.kit.native) --------------------------------

def step_context(tables, lens, slots, query_masks=None):
    from lmplug.interfaces.step import StepContext

    b = len(lens)
    ones = torch.ones(b, dtype=torch.int32)
    return StepContext(positions=(lens - 1).long(), query_lens=ones, seq_lens=lens,
                       cu_query_lens=torch.arange(b + 1, dtype=torch.int32), slot_mapping=slots,
                       block_tables=tables, query_lens_cpu=[1] * b, seq_lens_cpu=lens.tolist(), num_decodes=b,
                       query_masks=query_masks or {})


def test_step_attention_writes_the_rows_then_gives_the_kernels_bits(native):
    """Each row's k and v go to its slot of the layer's caches, and the output is the decode
    kernel's over the updated caches, bit for bit (1 row: one thread; 10 rows: several)."""
    from lmplug.interfaces.attention import KVLayerView
    from lmplug.kit.native import call_attention

    for lens_list in ([33], LENS):
        q, kc, vc, tables, lens = paged_batch(lens_list, 9, 3, 64, 16, torch.float32, seed=8)
        slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens_list)])
        g = torch.Generator().manual_seed(9)
        k, v = torch.randn(len(lens_list), 3, 64, generator=g), torch.randn(len(lens_list), 3, 64, generator=g)
        other = KVLayerView(torch.zeros_like(kc), torch.zeros_like(vc), "paged")
        views = [other, KVLayerView(kc, vc, "paged")]  # the step's layer 1
        call = native.step_attention(step_context(tables, lens, slots), views, 9, 3, 64, 0.125, None, "attention t")
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        got = call_attention(call, 1, qkv, 9, 64, threads=2)
        assert torch.equal(kc.view(-1, 3, 64)[slots], k) and torch.equal(vc.view(-1, 3, 64)[slots], v)
        assert not other.k_cache.any()
        assert torch.equal(got, native.paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_threads=1))
        with pytest.raises(RuntimeError, match="attention t's native function returned error -3"):
            call_attention(call, 2, qkv, 9, 64)  # a layer the step does not have


def test_step_attention_takes_each_layers_scale_window_and_softcap(native):
    """Per cache layer (Gemma 2/3): layer 0 plain, layer 1 a window of 8, another scale and a soft-cap;
    each layer's output is the kernel's with that layer's parameters, bit for bit. Sinks: declined."""
    from lmplug.interfaces.attention import KVLayerView, LayerAttention
    from lmplug.kit.native import call_attention

    specs = (LayerAttention(0.125), LayerAttention(0.3, 8, 20.0))
    q, kc, vc, tables, lens = paged_batch(LENS, 9, 3, 64, 16, torch.float32, seed=11)
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(LENS)])
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(len(LENS), 3, 64, generator=g), torch.randn(len(LENS), 3, 64, generator=g)
    views = [KVLayerView(kc.clone(), vc.clone(), "paged"), KVLayerView(kc.clone(), vc.clone(), "paged")]
    call = native.step_attention(step_context(tables, lens, slots), views, 9, 3, 64, 0.125, None, "attention t",
                                 specs)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    for layer, spec in enumerate(specs):
        got = call_attention(call, layer, qkv, 9, 64)
        view = views[layer]
        want = native.paged_decode_attention(q, view.k_cache, view.v_cache, tables, lens, spec.scale,
                                             sliding_window=spec.sliding_window, softcap=spec.softcap, num_threads=1)
        assert torch.equal(got, want), layer
    assert not torch.equal(call_attention(call, 0, qkv, 9, 64), call_attention(call, 1, qkv, 9, 64))
    sinks = (specs[0], LayerAttention(0.125, sinks=True))
    assert native.step_attention(step_context(tables, lens, slots), views, 9, 3, 64, 0.125, None, "attention t",
                                 sinks) is None


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_step_attention_reads_a_verifys_short_queries_as_rows(native, tree):
    """A decode (20 positions) and a verify of 4 new tokens after 29 cached (a chain, or a tree:
    root, two children of the root, a child of the first): each query token is a decode row of
    its sequence's table over its first positions, tree rows masked to their ancestors; the
    result is the kernel's on those rows, bit for bit, after every row's K/V is written."""
    from lmplug.interfaces.attention import KVLayerView
    from lmplug.interfaces.step import StepContext
    from lmplug.kit.native import call_attention

    q, kc, vc, tables, _ = paged_batch([20, 33], 4, 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(4))
    k, v = torch.randn(2, 5, 2, 64, generator=torch.Generator().manual_seed(5))
    slots = torch.tensor([int(tables[b, p // 16]) * 16 + p % 16 for b, p in [(0, 19), (1, 29), (1, 30), (1, 31),
                                                                          (1, 32)]])
    parents = [-1, 0, 0, 1]  # node j's parent among the new tokens
    mask = torch.eye(4, dtype=torch.bool)
    for j, p in enumerate(parents):
        while p >= 0:
            mask[j, p], p = True, parents[p]
    positions = torch.tensor([19, 29, 30, 30, 31] if tree else [19, 29, 30, 31, 32])
    ctx = StepContext(positions=positions, query_lens=torch.tensor([1, 4], dtype=torch.int32),
                      seq_lens=torch.tensor([20, 33], dtype=torch.int32),
                      cu_query_lens=torch.tensor([0, 1, 5], dtype=torch.int32), slot_mapping=slots,
                      block_tables=tables, query_lens_cpu=[1, 4], seq_lens_cpu=[20, 33], num_decodes=1,
                      query_masks={1: mask} if tree else {})
    call = native.step_attention(ctx, [KVLayerView(kc, vc, "paged")], 4, 2, 64, 0.125, None, "attention t")
    got = call_attention(call, 0, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), 4, 64)
    assert torch.equal(kc.view(-1, 2, 64)[slots], k) and torch.equal(vc.view(-1, 2, 64)[slots], v)
    rows = {"block_tables": tables[[0, 1, 1, 1, 1]], "seq_lens": torch.tensor([20, 30, 31, 32, 33], dtype=torch.int32)}
    if tree:
        bits = [sum(1 << a for a in range(4) if mask[j, a]) for j in range(4)]
        rows.update(mask_starts=torch.tensor([-1, 29, 29, 29, 29], dtype=torch.int32),
                    masks=torch.tensor([0] + bits, dtype=torch.int64))
    assert torch.equal(got, native.paged_decode_attention(q, kc, vc, scale=0.125, num_threads=1, **rows))


# (last length, rows): a verify's chain of k + 1 rows ends at its last length; 1: a decode row.
# Chains across the 32-position chunks (30..34, 61..76), from the first position, and two
# sequences whose lengths happen to run on (16 then 17): their tables differ, so not one chain.
CHAINS = [(34, 5), (16, 1), (17, 1), (76, 16), (3, 3), (64, 2), (33, 2)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 40), (4, 4, 80)])
@pytest.mark.parametrize("threads", [1, 2])
def test_step_attention_reads_a_chain_once_with_each_rows_bits(native, num_heads, num_kv_heads, head_dim,
                                                               threads):
    """A verify's chain (rows of one table, lengths one apart) is attended as one task per KV
    head, the K/V read once for all its rows: each row still gets, bit for bit, what the
    kernel gives it alone (its scores past its own length weigh exactly 0). Per layer: plain,
    a soft-cap with a window longer than every row (still chains) and a window of 8 (rows alone);
    caches poisoned with NaN wherever no row may read."""
    from lmplug.interfaces.attention import KVLayerView, LayerAttention
    from lmplug.kit.native import call_attention

    lasts = [last for last, _ in CHAINS]
    _, kc, vc, tables, _ = paged_batch(lasts, num_heads, num_kv_heads, head_dim, 4, torch.float32, seed=21,
                                       poison=True)
    owner = [i for i, (_, rows) in enumerate(CHAINS) for _ in range(rows)]
    lens = torch.tensor([last - rows + 1 + j for last, rows in CHAINS for j in range(rows)], dtype=torch.int32)
    row_tables = tables[owner]
    slots = torch.tensor([int(row_tables[r, (n - 1) // 4]) * 4 + (n - 1) % 4 for r, n in enumerate(lens.tolist())])
    g = torch.Generator().manual_seed(22)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    k, v = (torch.randn(len(lens), num_kv_heads, head_dim, generator=g) for _ in range(2))
    specs = (LayerAttention(head_dim ** -0.5), LayerAttention(0.3, 100, 20.0), LayerAttention(0.2, 8))
    views = [KVLayerView(kc.clone(), vc.clone(), "paged") for _ in specs]
    call = native.step_attention(step_context(row_tables, lens, slots), views, num_heads, num_kv_heads, head_dim,
                                 head_dim ** -0.5, None, "attention t", specs)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    for layer, spec in enumerate(specs):
        got = call_attention(call, layer, qkv, num_heads, head_dim, threads=threads)
        view = views[layer]
        want = native.paged_decode_attention(q, view.k_cache, view.v_cache, row_tables, lens, spec.scale,
                                             sliding_window=spec.sliding_window, softcap=spec.softcap,
                                             num_threads=1)
        assert not got.isnan().any()
        assert torch.equal(got, want), layer


def test_step_attention_declines_or_refuses(native):
    from lmplug.interfaces.attention import KVLayerView

    _, kc, vc, tables, lens = paged_batch([5, 20], 4, 2, 64, 16, torch.float32)
    slots = torch.tensor([4, 16 * int(tables[1, 1]) + 3])
    view = KVLayerView(kc, vc, "paged")
    args = (4, 2, 64, 0.125, None, "attention t")
    prefill = step_context(tables, lens, slots)
    prefill.query_lens_cpu, prefill.num_decodes = [1, 33], 1  # longer than paged_rows reads as rows
    assert native.step_attention(prefill, [view], *args) is None
    int8 = KVLayerView(kc.to(torch.int8), vc.to(torch.int8), "paged", kc[..., 0], vc[..., 0])
    assert native.step_attention(step_context(tables, lens, slots), [int8], *args) is None
    assert native.step_attention(step_context(tables, lens, slots), [KVLayerView(kc.bfloat16(), vc.bfloat16(),
                                                                                 "paged")], *args) is None
    # the C function checks the tables and slots it would trust, before writing anything
    from lmplug.kit.native import call_attention

    qkv = torch.zeros(2, (4 + 2 * 2) * 64)
    before = kc.clone()
    cases = [(step_context(tables, lens, torch.tensor([4, kc.shape[0] * 16])), "error -2 .slot_mapping names a slot"),
             (step_context(torch.full_like(tables, kc.shape[0]), lens, slots), "error -5 .block_tables name a block"),
             (step_context(tables[:, :1], lens, slots), "error -4 .seq_lens outside"),
             (step_context(tables, torch.tensor([0, 20], dtype=torch.int32), slots), "error -4")]
    for ctx, message in cases:
        call = native.step_attention(ctx, [view], *args)
        with pytest.raises(RuntimeError, match=f"attention t's native function returned {message}"):
            call_attention(call, 0, qkv, 4, 64)
    assert torch.equal(kc, before)
