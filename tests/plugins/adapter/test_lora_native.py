"""The native CPU LoRA product (``lmplug_adapter.lora_native``, ``csrc/lora_cpu.c``).

References: the torch backend's ``apply`` (the family's reference, itself PEFT-parity tested in
``tests/core/adapters/test_lora_parity.py``) for the update alone, with every kernel set this CPU
runs; and, for whole engines, the same LoRA engine with the Python layers (``LMPLUG_NATIVE_STEP=0``)
on a tiny packed GGUF model, compared as the native step's own tests compare (``assert_same``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from support.gguf_fixtures import write_tiny_gguf
from support.lora_adapters import write_adapter
from support.native_compare import assert_same

from lmplug import LLM, LoRARequest, SamplingParams
from lmplug.interfaces.adapter import AdapterOptions
from lmplug.interfaces.quant import Unquantized
from lmplug.kit import fused_cpu, hugemem
from lmplug.kit.layers import Linear
from lmplug.kit.lora import LinearLoRA, LoRAStep
from lmplug.kit.native_step import NativeDecodeStep


def _native():
    from lmplug_adapter import lora_native

    return lora_native


def _isas() -> list[str]:
    lora_native = _native()
    return list(lora_native.ISAS[:lora_native.load().lora_cpu_isa() + 1])


def _layer(shards: dict[str, int], d_in: int, rank: int, slots: int = 3, dtype: torch.dtype = torch.float32,
           scale: float | None = None) -> LinearLoRA:
    """A fused layer's LoRA slots, each slot a random adapter over some of its shards (ranks 1 to
    ``rank``; one slot leaves a shard out), its A and B in ``dtype`` (and given ``scale``: the
    scaling apart, as the PEFT loader hands it)."""
    from lmplug_adapter.torch_lora import TorchLoRA

    linear = Linear(d_in, shards, bias=False, dtype=torch.float32, quant=Unquantized())
    step = LoRAStep(TorchLoRA(AdapterOptions(max_loras=slots, max_lora_rank=rank)))
    lora = LinearLoRA(linear, list(shards), step, slots, rank)
    g = torch.Generator().manual_seed(0)
    for s in range(slots):
        given = {}
        for k, size in enumerate(shards.values()):
            if s == 1 and k == 1:
                continue
            r = 1 + (s + k) % rank
            a, b = torch.randn(r, d_in, generator=g).to(dtype), torch.randn(size, r, generator=g).to(dtype)
            given[k] = (a, b) if scale is None else (a, b, scale * (k + 1))
        lora.fill(s, given)
    return lora


def _lora_add(lora: LinearLoRA, x: torch.Tensor, y: torch.Tensor, threads: int = 1,
              parallel_for: int | None = None) -> int:
    lora_native = _native()
    lib = lora_native.load()
    ctx, _keep = lora_native.context(lora, None, lib, parallel_for)  # _keep: what ctx points into
    return lib.lora_add(ctypes.addressof(ctx), x.data_ptr(), x.shape[0], y.data_ptr(), threads)


def _gguf_pool() -> object:
    """The GGUF kernels' library: the thread pool the engine's LoRA products share (``parallel_for``)."""
    from lmplug_quant import gguf_native

    return gguf_native.load()


_RANGE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
def _backwards(range_fn, ctx, n, threads):
    """A ``parallel_for`` that runs [0, n) one unit at a time from the last: any order must give the same bits."""
    for u in reversed(range(n)):
        _RANGE(range_fn)(ctx, u, u + 1)


BACKWARDS = ctypes.cast(_backwards, ctypes.c_void_p).value


def _assert_update_is_the_reference(lora: LinearLoRA, d_in: int) -> None:
    """The C update of a batch's rows (some without an adapter) equals the torch backend's over
    the layer's float32 slots; rows without an adapter keep the base's bits. Split over 2 and 3
    threads of the GGUF pool, and run unit by unit backwards, it gives the one-thread bits."""
    token_slots = [-1, 0, 2, 1, 0, -1, 2, 1]
    lora.step.set(token_slots, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(token_slots), d_in, generator=g)
    base = torch.randn(len(token_slots), lora.out_features, generator=g)
    want = base.clone()
    lora.step.backend.apply(want, x, lora.a, lora.b, lora.step.meta)
    got = base.clone()
    assert _lora_add(lora, x, got) == 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    keep = torch.tensor([s < 0 for s in token_slots])
    assert torch.equal(got[keep], base[keep])
    assert not torch.allclose(got[~keep], base[~keep])
    pool = _gguf_pool()
    for threads, parallel_for in ((2, pool.parallel_for), (3, pool.parallel_for), (2, BACKWARDS)):
        split = base.clone()
        assert _lora_add(lora, x, split, threads, parallel_for) == 0
        assert torch.equal(split, got), (threads, parallel_for)
    assert pool.pool_workers() >= 2  # the 3-thread call ran on the pool's workers


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize(("shards", "d_in", "rank"), [({"q": 24, "k": 8, "v": 8}, 37, 5),
                                                      ({"gate": 40, "up": 40}, 64, 16),
                                                      ({"down": 19}, 130, 3), ({"q": 21, "k": 11}, 48, 8),
                                                      ({"gate": 150, "up": 77}, 40, 8)])
def test_update_equals_the_torch_reference(monkeypatch, isa, shards, d_in, rank):
    """Dimensions off the vector widths (tails; shards of many expand blocks), ranks below the
    slot width, rows without an adapter left bit-identical, one slot without a shard."""
    if isa not in _isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv("LMPLUG_LORA_ISA", isa)
    lora = _layer(shards, d_in, rank)
    _assert_update_is_the_reference(lora, d_in)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shards", "d_in", "rank"), [({"q": 24, "k": 8, "v": 8}, 37, 5),
                                                      ({"gate": 40, "up": 40}, 64, 16), ({"down": 19}, 130, 3),
                                                      ({"gate": 150, "up": 77}, 40, 8)])
def test_16_bit_slots_equal_the_torch_reference(monkeypatch, isa, dtype, shards, d_in, rank):
    """A 16-bit adapter's slots stay 16-bit (the file's bits) and give the torch product over its
    weights upcast to float32 (the layer's float32 slots, the scaling folded into B)."""
    if isa not in _isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv("LMPLUG_LORA_ISA", isa)
    lora = _layer(shards, d_in, rank, dtype=dtype, scale=0.37)
    native = lora.native
    assert native.dtype.tolist() == [native.DTYPES.index(dtype)] * 3
    assert torch.equal(native.a16[0].view(dtype).float(), lora.a[0])
    _assert_update_is_the_reference(lora, d_in)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_conversion_is_exact(monkeypatch, isa, dtype):
    """Row t's x is the unit vector e_t and B is 1, so the update is A's t-th value converted:
    every one equals torch's conversion, subnormals and extremes included."""
    if isa not in _isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv("LMPLUG_LORA_ISA", isa)
    info = torch.finfo(dtype)
    special = [info.tiny, -info.tiny / 2, info.tiny * info.eps, 3 * info.tiny * info.eps, info.max, -info.max, 0.0]
    values = torch.tensor(special + torch.randn(57, generator=torch.Generator().manual_seed(2)).tolist()).to(dtype)
    n = values.numel()
    lora = _layer({"o": 1}, n, 1, slots=1)
    lora.fill(0, {0: (values[None], torch.ones(1, 1, dtype=dtype), 1.0)})
    lora.step.set([0] * n, torch.device("cpu"))
    got = torch.zeros(n, 1)
    assert _lora_add(lora, torch.eye(n), got) == 0
    assert torch.equal(got[:, 0], values.float())


def test_errors_are_reported():
    lora = _layer({"q": 8}, 16, 4)
    x, y = torch.zeros(3, 16), torch.zeros(3, 8)
    lora.step.set([0, -1], torch.device("cpu"))
    assert _lora_add(lora, x, y) == -201  # the map has 2 rows, the product 3
    lora.step.set([0, 7, -1], torch.device("cpu"))
    assert _lora_add(lora, x, y) == -202  # slot 7 of 3
    assert -201 in _native().ERRORS and -202 in _native().ERRORS


def test_isa_is_bounded_by_proc_cpuinfo(monkeypatch):
    """A set /proc/cpuinfo's flags do not list is never chosen, whatever CPUID says (a feature
    the operating system turned off)."""
    from lmplug.kit import native_build

    native, lib = _native(), _native().load()
    monkeypatch.delenv("LMPLUG_LORA_ISA", raising=False)
    monkeypatch.setattr(native_build, "cpu_id", lambda: "flags\t\t: fpu sse2")
    assert native.isa(lib) == 0
    monkeypatch.setattr(native_build, "cpu_id", lambda: "flags\t\t: fpu sse2 avx2 fma f16c avx512f")
    assert native.isa(lib) == lib.lora_cpu_isa()


def test_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv("LMPLUG_LORA_ISA", "sse9")
    with pytest.raises(ValueError, match="LMPLUG_LORA_ISA"):
        _native().isa(_native().load())


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hugemem.enabled() or not Path("/proc/self/smaps").exists(),
                    reason="huge pages are Linux's (madvise)")
@pytest.mark.parametrize("huge", [True, False])
def test_slots_are_in_huge_page_memory(monkeypatch, huge):
    """The slots the native product streams (A float32 and 16-bit, compact B) lie in mappings the
    kernel was asked to back with huge pages (VmFlags ``hg``: madvise(MADV_HUGEPAGE)), unless
    ``LMPLUG_HUGE_PAGES=0``; and they start zeroed."""
    monkeypatch.setenv("LMPLUG_HUGE_PAGES", "1" if huge else "0")
    lora = _layer({"q": 24, "k": 8}, 64, 4, slots=2)
    fresh = LinearLoRA(Linear(64, {"q": 24, "k": 8}, bias=False, dtype=torch.float32, quant=Unquantized()),
                       ["q", "k"], lora.step, 2, 4)
    for t in (fresh.a, fresh.native.a16, fresh.native.b):
        assert not t.any()
    for t in (lora.a, lora.native.a16, lora.native.b):
        assert ("hg" in _vm_flags(t.data_ptr())) == huge


# -- whole engines: the native decode step with LoRA ------------------------------------------------

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "quant": {"method": "gguf", "kernel": "native"},
          "lora": {"max_loras": 2, "max_lora_rank": 8}}
PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31], [9, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")
def test_native_step_serves_adapters(tmp_path, monkeypatch):
    """Three adapters (ranks 4, 8, 8) over two slots and the base in one batch (groups, slot
    evictions): every decode step native, the result the Python layers'; the adapters move it."""
    _native_equals_python(tmp_path, monkeypatch, [torch.float32] * 3)


@pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")
def test_native_step_serves_16_bit_adapters(tmp_path, monkeypatch):
    """float16, float32 and bfloat16 adapter files sharing two slots (a slot changes dtype when
    evicted): the native slots keep each file's dtype, and the result is the Python layers' (their
    float32 slots: the file's weights upcast)."""
    dtypes = _native_equals_python(tmp_path, monkeypatch, [torch.float16, torch.float32, torch.bfloat16])
    assert {1, 2} <= dtypes  # float16 and bfloat16 slots were served natively


def _native_equals_python(tmp_path, monkeypatch, dtypes: list[torch.dtype]) -> set[int]:
    """The engine test above with adapter files of ``dtypes``; returns the native slots' dtype
    codes seen after the native run."""
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama")
    native_steps = []
    run = NativeDecodeStep.run
    seen: set[int] = set()

    def counting(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        native_steps.append(out is not None)
        seen.update(self.model.layers[0].self_attn.qkv_proj.lora.native.dtype.tolist())
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", counting)
    outs = {}
    for native in (True, False):
        monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1" if native else "0")
        with LLM(str(path), **ENGINE) as llm:
            if not outs:
                for k, (rank, dtype) in enumerate(zip((4, 8, 8), dtypes)):
                    write_adapter(tmp_path / f"a{k}", llm.engine.adapters.targets, rank, seed=k, scale=0.3,
                                  dtype=dtype)
            loras = [LoRARequest(f"a{k}", k + 1, str(tmp_path / f"a{k}")) for k in range(3)]
            outs[native] = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, lora=[*loras, None])]
            base = [o.outputs[0] for o in llm.generate(PROMPTS[:3], GREEDY)]
            assert bool(llm.engine.parts.model._native_step) == native
        if native:
            assert len(native_steps) >= 2 * (GREEDY.max_tokens - 1) and all(native_steps)
    assert_same(outs[True], outs[False])
    for with_lora, plain in zip(outs[False][:3], base):
        assert with_lora.token_ids != plain.token_ids
    return seen


@pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")
def test_native_step_threads_give_the_same_bits(tmp_path, monkeypatch, torch_threads):
    """The LoRA update on the GGUF products' threads (``NativeCall.parallel_for``): at 1, 2 and 3
    threads the native step gives the same tokens and logprobs, bit for bit."""
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama")
    monkeypatch.setenv("LMPLUG_NATIVE_STEP", "1")
    outs = []
    with LLM(str(path), **ENGINE) as llm:
        write_adapter(tmp_path / "a0", llm.engine.adapters.targets, 8, seed=0, scale=0.3, dtype=torch.float16)
        write_adapter(tmp_path / "a1", llm.engine.adapters.targets, 4, seed=1, scale=0.3)
        loras = [LoRARequest("a0", 1, str(tmp_path / "a0")), LoRARequest("a1", 2, str(tmp_path / "a1"))]
        qkv = llm.engine.parts.model.layers[0].self_attn.qkv_proj
        for threads in (1, 2, 3):
            torch_threads(threads)
            outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                         for o in llm.generate(PROMPTS, GREEDY, lora=[*loras, loras[0], None])])
            assert llm.engine.parts.model._native_step
        assert qkv.lora.native_product(qkv.quant.native_product(qkv)).keep[0].parallel_for
    assert outs[1] == outs[0] and outs[2] == outs[0]
