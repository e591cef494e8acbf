"""The kernel sets over 16-row panels (csrc/gguf_repack.c): AVX-512 VNNI (gguf_avx512.c),
AVX-VNNI (gguf_vnni256.c, in whichever encoding this CPU runs: VEX, or EVEX on AVX-512 CPUs
without AVX-VNNI) and AVX2 (gguf_vnni256.c with vpdpbusd as vpmaddubsw + vpmaddwd, the 8-bit
values signed). The same bits as the portable kernels for every type with a panel kernel,
row counts of the small-M kernels and of GEMMs, weight row counts that are not a multiple of
the panel (a half-empty last panel too), 1 and 2 threads, repacked per call (``mul_mat``) and
once at bind (the bound and layer products). A set this CPU cannot run is skipped with the
reason; the repack itself and the kernel set's log line are checked everywhere."""

from __future__ import annotations

import logging

import pytest
import torch
from support.gguf_weights import file_rows, fp16_fields, make_weight, resident_kib, type_id

gguf_native = pytest.importorskip("lmplug_quant.gguf_native")

PANEL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


@pytest.fixture(params=["avx2", "avxvnni", "avx512"])
def panel_set(request, kernel):
    """A kernel set over panels this CPU runs (its name), else a skip that says why."""
    isa = request.param
    if isa not in gguf_native.ISAS or gguf_native.ISAS.index(kernel.best_isa) < gguf_native.ISAS.index(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernels: {gguf_native.describe_isa(kernel.best_isa)}")
    return isa


def portable(kernel, monkeypatch, x, w, name, k, isa):
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
    try:
        return kernel.mul_mat(x, w, type_id(name), k, num_threads=1)
    finally:
        monkeypatch.setenv("LMPLUG_GGUF_ISA", isa)


@pytest.mark.parametrize("name", PANEL_TYPES)
@pytest.mark.parametrize("n", [37, 16, 5])
def test_panels_give_the_portable_bits(kernel, panel_set, monkeypatch, name, n):
    k = 512
    w = torch.from_numpy(make_weight(name, n, k, seed=n))
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(n)) * 3
    want = portable(kernel, monkeypatch, x, w, name, k, panel_set)
    for m in (*range(1, 10), 33):  # decode, a verify step's k + 1 rows (each count its kernel), 8-row groups, a GEMM
        for threads in (1, 2):
            got = kernel.mul_mat(x[:m], w, type_id(name), k, num_threads=threads)
            assert torch.equal(got, want[:m]), (m, threads, (got - want[:m]).abs().max())


@pytest.mark.parametrize("name", PANEL_TYPES)
def test_largest_values_give_the_portable_bits(kernel, panel_set, monkeypatch, name):
    """Every quant byte 0xFF (each type's largest stored values: the AVX2 set's int16 pair sums
    at their largest, 2 x 63 x 127 for Q6_K, and their int16 totals), 0x00, 0x80 (Q8_0: -128) or
    0x7F, times activations that quantize to +127 or -127 throughout: the portable bits at every
    row count."""
    k, n, t = 512, 21, type_id(name)
    elems, size = gguf_native.BLOCKS[t]
    for fill in (0xFF, 0x00, 0x80, 0x7F):
        blocks = torch.full((n, k // elems, size), fill, dtype=torch.uint8)
        for at in fp16_fields(name):
            blocks[..., at:at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        w = blocks.reshape(n, -1)
        for sign in (1.0, -1.0):
            x = sign * torch.ones(9, k) * torch.linspace(1, 3, 9)[:, None]
            want = portable(kernel, monkeypatch, x, w, name, k, panel_set)
            for m in range(1, 10):
                got = kernel.mul_mat(x[:m], w, t, k, num_threads=1)
                assert torch.equal(got, want[:m]), (fill, sign, m, (got - want[:m]).abs().max())


def test_each_set_reads_its_panel_types(kernel):
    """The library says which types each set reads in panels (bound at load as panels): every x86
    SIMD set every type, the portable and NEON sets none."""
    every = {type_id(name) for name in PANEL_TYPES}
    for isa in gguf_native.ISAS:
        assert kernel.panel_types[isa] == (every if isa in ("avx2", "avxvnni", "avx512") else set()), isa


@pytest.mark.parametrize("name", PANEL_TYPES)
def test_bound_and_layer_products_read_panels_made_once(kernel, panel_set, monkeypatch, name):
    """Bound at a panel set, a product reads the panels (made at bind, shared by the bound product
    and the layer's native-step product of the same weight) and gives the portable bits."""
    from lmplug.kit.native import call_product

    k, n = 256 * 3, 45  # 24 blocks of 32 / 3 of 256, a partial last panel
    w = torch.from_numpy(make_weight(name, n, k, seed=11))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(11))
    want = portable(kernel, monkeypatch, x, w, name, k, panel_set)
    bound = gguf_native.BoundProduct(kernel, w, type_id(name), k)
    assert bound.ggml_type == type_id(name) | gguf_native.PACKED_FLAG and bound.w.data_ptr() != w.data_ptr()
    call = gguf_native.layer_product(kernel, [(type_id(name), w)], k, None)
    assert kernel.panels(w, type_id(name), k) is bound.w  # one repacked copy
    for m in (1, 5):
        assert torch.equal(bound(x[:m]), want[:m])
        assert torch.equal(call_product(call, x[:m], n, 2), want[:m])


@pytest.mark.parametrize("name", PANEL_TYPES)
def test_repack_puts_each_row_in_its_lane(kernel, name):
    """The panel layout, independent of the CPU: a row's fp16 scale sits at its lane (2 r) of
    its block's scale vector, rows past N are zero, and the size is whole panels."""
    k, n = 256, 18
    w = torch.from_numpy(make_weight(name, n, k, seed=4))
    panels = kernel.panels(w, type_id(name), k)
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q3_K": 114, "Q4_K": 148, "Q5_K": 180, "Q6_K": 210,
                   "IQ4_NL": 18, "IQ4_XS": 138}[name]
    elems = gguf_native.BLOCKS[type_id(name)][0]
    nb, pblock = k // elems, 16 * block_bytes
    assert panels.numel() == 32 * nb * block_bytes  # 2 panels of 16 rows
    scale_at = {"Q6_K": 208, "Q3_K": 108}.get(name, 0)
    for r in (0, 7, 15, 16, 17):
        for b in (0, nb - 1):
            blk = panels[(r // 16 * nb + b) * pblock:][:pblock]
            raw = w[r, b * (w.shape[1] // nb) + scale_at:][:2]
            assert torch.equal(blk[2 * (r % 16):][:2], raw)
    last = panels[(nb + nb - 1) * pblock:][:pblock]
    assert not last[4:32].any()  # the d of rows 18..31: zero


def test_the_kernel_set_is_logged_with_what_it_lacks(kernel, caplog):
    text = gguf_native.describe_isa("generic")
    assert text.startswith("portable C")
    assert gguf_native.describe_isa(kernel.best_isa) != ""
    with caplog.at_level(logging.INFO, logger="lmplug_quant.gguf_native"):
        gguf_native.GGUFKernel(*_reload(kernel))
    assert any("native CPU kernels:" in r.getMessage() for r in caplog.records)


def _reload(kernel):
    import ctypes

    return ctypes.CDLL(kernel.path), kernel.path


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_panels_release_the_rows_of_a_file_mapping(kernel, tmp_path):
    """Rows that are a view of a read-only memory map (as the GGUF reader leaves them) leave the
    process's resident memory once repacked, and still read the same bytes afterwards (faulted
    back in from the file); rows in ordinary memory are left alone."""
    k, n = 256, 4096  # 576 KiB of Q4_0 rows
    w = make_weight("Q4_0", n, k, seed=2)
    mapped = file_rows(tmp_path / "rows.bin", w)
    assert torch.equal(mapped, torch.from_numpy(w))  # every page now resident
    lo, hi = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    before = resident_kib(lo, hi)
    assert before >= 500
    panels = kernel.panels(mapped, type_id("Q4_0"), k)
    assert resident_kib(lo, hi) <= 8  # at most the two partial pages at the ends
    assert torch.equal(mapped, torch.from_numpy(w))
    assert torch.equal(panels, kernel.panels(torch.from_numpy(w.copy()), type_id("Q4_0"), k))
    assert not kernel.panels_only(mapped, type_id("Q4_0"), k)  # the file's rows stay as they are
    plain = torch.from_numpy(w.copy())
    assert not gguf_native.release_file_pages(plain)
    assert torch.equal(plain, torch.from_numpy(w))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_copies_made_at_load_release_the_file_pages(tmp_path):
    """Two shards that do not lie back to back (a Q4_K_M file's ffn_gate and ffn_up) are joined by a
    copy, and llama's q/k rows are reordered by one: the file's pages of what was copied leave the
    process's resident memory (they stayed beside the copies: 340 MB of a 1B Q4_K_M file)."""
    from types import SimpleNamespace

    import numpy as np
    from lmplug_quant.gguf import _join

    from lmplug.loading.gguf import _packed_tensor, unpermute_index

    k, n, gap = 256, 2048, 16  # two 288 KiB shards of Q4_0 rows, 16 rows apart
    w = make_weight("Q4_0", 2 * n + gap, k, seed=3)
    mapped = file_rows(tmp_path / "shards.bin", w)
    assert torch.equal(mapped, torch.from_numpy(w))  # every page now resident
    lo, hi = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    assert resident_kib(lo, hi) >= 500
    joined = _join(mapped[:n], mapped[n + gap:])
    assert torch.equal(joined, torch.from_numpy(np.concatenate([w[:n], w[n + gap:]])))
    assert resident_kib(lo, hi) <= 24  # the gap's rows and the partial pages at the shards' ends

    rows = 2 * n
    path = tmp_path / "q.bin"
    path.write_bytes(b"\0" * 100 + w[:rows].tobytes())
    file_bytes = torch.from_numpy(np.memmap(path, mode="r").view(np.ndarray))
    assert int(file_bytes.sum()) == int(w[:rows].astype(np.int64).sum())  # resident
    lo, hi = file_bytes.data_ptr(), file_bytes.data_ptr() + file_bytes.numel()
    tensor = SimpleNamespace(shape=np.array([k, rows]), data_offset=100, tensor_type=type_id("Q4_0"),
                             name="blk.0.attn_q.weight")
    packed = _packed_tensor(file_bytes, tensor, {"attn_q": 8})
    assert torch.equal(packed.data, torch.from_numpy(w[:rows])[unpermute_index(rows, 8)])
    assert resident_kib(lo, hi) <= 8


def test_shards_dequantized_at_load_release_the_file_pages(tmp_path):
    """A type no packed matmul reads (Q2_K) is dequantized at load: the float copy is what stays
    resident, not the file's pages of the packed rows too."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from lmplug_quant.gguf import GGUFQuant

    from lmplug.interfaces.packed import PackedTensor

    rows, k = 1024, 256  # 84 KiB of Q2_K: 84 bytes a row (one block)
    w = np.random.default_rng(5).integers(0, 256, (rows, 84), dtype=np.uint8)
    w[:, 80:84] = np.array([1e-3, 1e-3], dtype=np.float16).view(np.uint8)  # d, dmin: finite
    mapped = file_rows(tmp_path / "q2k.bin", w)
    lo, hi = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    assert torch.equal(mapped, torch.from_numpy(w)) and resident_kib(lo, hi) >= 80
    dense = GGUFQuant._usable(PackedTensor(mapped, int(GGMLQuantizationType.Q2_K), (rows, k), "blk.0.ffn_up"))
    assert dense.shape == (rows, k) and dense.dtype == torch.float32
    assert torch.equal(dense, PackedTensor(torch.from_numpy(w), 10, (rows, k), "x").dequantize())
    assert resident_kib(lo, hi) <= 8


def test_proc_cpuinfo_flags_bound_the_kernel_set(kernel, monkeypatch, caplog):
    """A feature /proc/cpuinfo does not list (the OS turned it off, or a CPU lacks it) rules its
    kernel set out whatever CPUID says, and the load's line names what is missing; without a
    flags line (not Linux) CPUID's answer stands."""
    no_vnni = "model name\t: test\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl"
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: no_vnni)
    assert gguf_native.cpuinfo_isa("avx512") == "avx2"
    assert gguf_native.cpuinfo_isa("avx2") == "avx2"
    assert "avx512 needs avx512_vnni" in gguf_native.describe_isa("avx2")
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: "model name\t: test\nflags\t\t: fpu sse2 avx512f")
    assert gguf_native.cpuinfo_isa("avx512") == "generic"
    assert gguf_native.describe_isa("generic").startswith("portable C (no SIMD kernel set runs here); avx2 needs avx2 fma f16c")
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: "aarch64 ")
    assert gguf_native.cpuinfo_isa("avx2") == "avx2"
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: no_vnni)
    with caplog.at_level(logging.INFO, logger="lmplug_quant.gguf_native"):
        loaded = gguf_native.GGUFKernel(*_reload(kernel))
    assert loaded.best_isa in ("generic", "avx2")
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "avx512")
    with pytest.raises(ValueError, match="runs at most"):
        loaded.isa()


@pytest.mark.parametrize("name", PANEL_TYPES)
def test_rows_come_back_from_the_panels_byte_for_byte(kernel, name):
    """The repack's inverse gives the file's bytes again (k-quants: random bytes, so every bit of
    their packed 6-bit scales and mins goes through the unpacked form and back)."""
    k, n = 512, 37
    w = torch.from_numpy(make_weight(name, n, k, seed=9))
    panels = kernel.panels(w, type_id(name), k)
    assert torch.equal(kernel.rows(panels, type_id(name), n, k), w)
    with pytest.raises(ValueError, match="are not the panels of 36"):
        kernel.rows(panels[:-1], type_id(name), 36, k)


def test_panels_only_forgets_a_private_copy(kernel):
    """Rows in this process's own memory (a copy made at load) are forgotten by their panels and
    the cache once the panels are the one copy; rows of a file mapping are not (``panels_only``)."""
    import gc
    import weakref

    k, n = 256, 40
    w = torch.from_numpy(make_weight("Q4_K", n, k, seed=3).copy())
    panels = kernel.panels(w, type_id("Q4_K"), k)
    assert kernel.panels_only(w, type_id("Q4_K"), k)
    assert not kernel.panels_only(w, type_id("Q4_K"), k)  # already forgotten
    gone = weakref.ref(w)
    del w
    gc.collect()
    assert gone() is None  # nothing but the caller held the rows
    assert kernel.rows(panels, type_id("Q4_K"), n, k).shape == (n, 144 * k // 256)


def test_avx_vnni_cpus_are_bounded_to_the_256_bit_set(monkeypatch):
    """An Intel client core (AVX2 and AVX-VNNI, no AVX-512) gets the avxvnni set; AVX-512's VNNI
    meets the same need (its EVEX twin); a CPU with neither stays at avx2, and the load's line
    names what each better set lacks."""
    monkeypatch.setattr(gguf_native, "ISAS", gguf_native.kernel_sets("x86_64"))
    client = "model name\t: test\nflags\t\t: fpu sse2 avx2 fma f16c avx_vnni"
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: client)
    assert gguf_native.cpuinfo_isa("avxvnni") == "avxvnni"
    assert gguf_native.cpuinfo_isa("avx2") == "avx2"  # CPUID's answer bounds it too
    text = gguf_native.describe_isa("avxvnni", panels=True)
    assert text.startswith("AVX-VNNI (256-bit vpdpbusd) over 16-row panels")
    assert "avx512 needs avx512f avx512bw avx512vl avx512_vnni" in text
    zen4 = "model name\t: test\nflags\t\t: fpu avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni"
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: zen4)
    assert gguf_native.cpuinfo_isa("avx512") == "avx512"
    assert gguf_native.describe_isa("avx2") == "AVX2 (+FMA, F16C)"  # asked for below its best: nothing lacking
    older = "model name\t: test\nflags\t\t: fpu avx2 fma f16c"
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: older)
    assert gguf_native.cpuinfo_isa("avxvnni") == "avx2"
    assert "avxvnni needs avx_vnni or avx512_vnni" in gguf_native.describe_isa("avx2")


def test_the_vnni_encoding_follows_the_cpu(kernel):
    """The avxvnni set runs its VEX twin where the CPU has AVX-VNNI, its EVEX twin where only
    AVX-512 VL + VNNI stand in (then the panel tests above ran the EVEX twin: the same source)."""
    if "avxvnni" not in gguf_native.ISAS:
        pytest.skip(f"no AVX-VNNI set on {gguf_native.ISAS}")
    flags = set(gguf_native.native_build.cpu_id().split())
    if "avx_vnni" in flags:
        assert kernel.vnni_encoding == "VEX"
    elif {"avx512_vnni", "avx512vl"} <= flags:
        assert kernel.vnni_encoding == "EVEX"
    elif "avx2" in flags:
        assert kernel.vnni_encoding is None and gguf_native.ISAS.index(kernel.best_isa) <= 1


def test_the_vex_twin_needs_no_avx512(kernel):
    """What an AVX-VNNI CPU without AVX-512 runs: each row count's kernel of every type is in the
    library, its dot products VEX-encoded, and none of its instructions needs AVX-512 (no zmm or
    mask registers, no ymm16-31). On a CPU without AVX-VNNI this disassembly is the check that
    runs: the kernels' arithmetic was run above through the EVEX twin."""
    import re
    import shutil
    import subprocess

    if "avxvnni" not in gguf_native.ISAS:
        pytest.skip(f"no AVX-VNNI set on {gguf_native.ISAS}")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: the VEX twin's encoding cannot be read")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", kernel.path], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    bodies = dict(re.findall(r"^[0-9a-f]+ <([^>]+)>:\n(.*?)(?=\n\n|\Z)", text, flags=re.MULTILINE | re.DOTALL))
    vex = {name: body for name, body in bodies.items() if re.match(r"\w+_v256_\w+_vex\b", name)}
    counts = {re.match(r"(\w+)_v256_(\w+?)_vex", name).groups() for name in vex}
    types = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
    rows = ["1", "2", "3", "4"]  # 5 to 8 rows run as 4 and the rest
    assert {(t, r) for t in types for r in rows} <= counts
    for name, body in vex.items():
        assert "{vex} vpdpbusd" in body, name
        assert not re.search(r"%zmm|%k[0-7]|%[xy]mm(1[6-9]|2\d|3[01])\b|\{evex\}", body), name
