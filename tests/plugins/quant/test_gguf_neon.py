"""The aarch64 NEON and NEON + dotprod kernels (csrc/gguf_neon.c) bit-exact against the portable
ones. There is no ARM CPU here: the library is built for aarch64 with Debian's cross compiler
from the same source and flags gguf_native builds with, linked to a small C driver
(tests/support/gguf_isa_driver.c) and run under qemu-aarch64 as a CPU with dotprod (``max``) and
one without (``cortex-a53``). Those tests are skipped, saying so, where ``aarch64-linux-gnu-gcc``
or ``qemu-aarch64`` is missing (Debian: ``apt-get install crossbuild-essential-arm64 qemu-user``).

Weights: every byte random but the fp16 scales (finite), all 6 types, several block counts,
weight rows (partial 16-row tiles) and activation rows (GEMV groups of up to 8 and more), 1 and
2 threads; plus the extreme values (Q8_0's -128 weights times activations at +-127).
"""

from __future__ import annotations

import platform
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from support.gguf_weights import BLOCKS, type_id

gguf_native = pytest.importorskip("lmplug_quant.gguf_native")

CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
DRIVER = Path(__file__).resolve().parents[2] / "support" / "gguf_isa_driver.c"
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# (M, N, blocks): decode and every small-M count, partial and whole tiles, block counts that
# are and are not multiples of 4
SHAPES = [(1, 1, 1), (1, 37, 5), (2, 16, 3), (3, 5, 2), (4, 17, 4), (5, 3, 7), (7, 9, 1), (8, 33, 2),
          (9, 16, 6), (16, 5, 3), (17, 2, 8)]
THREADED = [(1, 64), (9, 48)]  # (M, N) at K = 4096: enough work for gguf_cpu_threads to give 2 threads


# a block's fp16 scales (first byte, how many) and its quantized values (first byte, end)
SCALES = {"Q4_0": (0, 1), "Q4_1": (0, 2), "Q8_0": (0, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1),
          "IQ4_NL": (0, 1), "IQ4_XS": (0, 1)}
QUANTS = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q8_0": (2, 34), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


def random_blocks(name: str, n: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, blocks, block bytes]: random bytes, the fp16 scales replaced by finite ones
    (every other bit pattern of these types is valid)."""
    w = rng.integers(0, 256, (n, blocks, BLOCKS[type_id(name)][1]), dtype=np.uint8)
    first, count = SCALES[name]
    scales = rng.uniform(1e-3, 1e-1, (n, blocks, count)) * rng.choice([-1, 1], (n, blocks, count))
    w[..., first:first + 2 * count] = scales.astype(np.float16).view(np.uint8)
    return w


def cases() -> list[tuple[str, int, int, np.ndarray, np.ndarray]]:
    """(type, M, threads, weights, activations) for every type and shape, then the extremes."""
    rng = np.random.default_rng(44)
    out = []
    for name in TYPES:
        elems = BLOCKS[type_id(name)][0]
        threaded = [(m, n, 4096 // elems) for m, n in THREADED]
        for shapes, threads in ((SHAPES, 1), (threaded, 2)):
            for m, n, blocks in shapes:
                x = (rng.standard_normal((m, blocks * elems)) * rng.uniform(0.1, 10)).astype(np.float32)
                out.append((name, m, threads, random_blocks(name, n, blocks, rng).reshape(n, -1), x))
    for name in TYPES:  # the largest |products|: every quant byte 0x80 / 0xFF, activations at +-127
        elems = BLOCKS[type_id(name)][0]
        for fill in (0x80, 0xFF):
            w = random_blocks(name, 5, 8, rng)
            w[..., slice(*QUANTS[name])] = fill
            x = np.where(rng.integers(0, 2, (3, 8 * elems)) > 0, 1.0, -1.0).astype(np.float32)
            out.append((name, 3, 1, w.reshape(5, -1), x))
    return out


def write_cases(path: Path, all_cases) -> None:
    with path.open("wb") as f:
        f.write(struct.pack("<i", len(all_cases)))
        for name, m, threads, w, x in all_cases:
            f.write(struct.pack("<6i", type_id(name), m, x.shape[1], w.shape[0], threads, w.shape[1]))
            f.write(np.ascontiguousarray(w).tobytes())
            f.write(np.ascontiguousarray(x).tobytes())


def read_results(path: Path, all_cases) -> list[list[tuple[int, np.ndarray]]]:
    """Per case, per kernel set 0..2: (status, the [M, N] results' float32 bits as uint32)."""
    data, pos, out = path.read_bytes(), 0, []
    for _, m, _, w, _ in all_cases:
        per_isa = []
        for _ in range(3):
            status = struct.unpack_from("<i", data, pos)[0]
            bits = np.frombuffer(data, np.uint32, m * w.shape[0], pos + 4).reshape(m, w.shape[0])
            per_isa.append((status, bits))
            pos += 4 + 4 * m * w.shape[0]
        out.append(per_isa)
    assert pos == len(data)
    return out


def run_ok(command: list[str]) -> str:
    """The command's stdout; a failure shows its stderr."""
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def arm_build(tmp_path_factory):
    """(driver, library, sysroot): the library built for aarch64 as gguf_native builds it."""
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no aarch64 cross toolchain / emulator here ({', '.join(missing)} not found; Debian: "
                    f"apt-get install crossbuild-essential-arm64 qemu-user): the NEON kernels are untested")
    root = tmp_path_factory.mktemp("arm")
    lib = root / "libgguf_cpu.so"
    run_ok([CROSS_CC, *gguf_native.FLAGS, "-Wall", "-Werror", "-o", str(lib), str(gguf_native.SOURCE)])
    driver = root / "driver"
    run_ok([CROSS_CC, "-O1", "-Wall", "-Werror", "-o", str(driver), str(DRIVER), str(lib),
                     "-Wl,-rpath," + str(root)])
    libc = run_ok([CROSS_CC, "-print-file-name=libc.so.6"]).strip()
    return driver, lib, Path(libc).resolve().parent.parent


def run_driver(arm_build, cpu: str, all_cases, tmp_path: Path) -> tuple[int, list]:
    driver, _, sysroot = arm_build
    write_cases(tmp_path / "cases", all_cases)
    printed = run_ok([QEMU, "-cpu", cpu, "-L", str(sysroot), str(driver), str(tmp_path / "cases"), str(tmp_path / "out")])
    return int(printed.split()[1]), read_results(tmp_path / "out", all_cases)


def test_neon_and_dotprod_give_the_portable_bits(arm_build, tmp_path):
    """On a CPU with dotprod the run-time choice is the dotprod set, and both NEON sets give
    the portable kernels' bits for every type, shape and thread count."""
    all_cases = cases()
    best, results = run_driver(arm_build, "max", all_cases, tmp_path)
    assert best == 2  # qemu's "max" CPU reports asimddp: gguf_cpu_isa picks the dotprod kernels
    for (name, m, threads, w, _), per_isa in zip(all_cases, results):
        where = f"{name} M={m} N={w.shape[0]} threads={threads}"
        assert [status for status, _ in per_isa] == [0, 0, 0], where
        generic = per_isa[0][1]
        assert np.isfinite(generic.view(np.float32)).all() and generic.any(), where
        for isa in (1, 2):
            np.testing.assert_array_equal(per_isa[isa][1], generic, err_msg=f"{gguf_native.kernel_sets('aarch64')[isa]} "
                                                                           f"{where}")


def test_without_dotprod_the_neon_set_runs(arm_build, tmp_path):
    """A CPU without dotprod (Cortex-A53: ARMv8.0) gets the base NEON set, which uses no SDOT
    (qemu would stop it with SIGILL) and gives the portable bits; asking for dotprod is refused."""
    all_cases = [c for c in cases() if c[2] == 1][::7]
    best, results = run_driver(arm_build, "cortex-a53", all_cases, tmp_path)
    assert best == 1
    for (name, m, _, w, _), per_isa in zip(all_cases, results):
        assert [status for status, _ in per_isa] == [0, 0, -4], name
        np.testing.assert_array_equal(per_isa[1][1], per_isa[0][1], err_msg=f"{name} M={m} N={w.shape[0]}")


def test_arm_portable_kernels_are_this_machines(arm_build, kernel, tmp_path, monkeypatch):
    """The aarch64 build's portable kernels give the bits this machine's build gives (whose math
    test_gguf_native.py checks against an exact simulation and gguf-py's dequantize)."""
    all_cases = [c for c in cases() if c[2] == 1][::3]
    _, results = run_driver(arm_build, "max", all_cases, tmp_path)
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
    for (name, m, _, w, x), per_isa in zip(all_cases, results):
        here = kernel.mul_mat(torch.from_numpy(x), torch.from_numpy(w), type_id(name), x.shape[1], num_threads=1)
        np.testing.assert_array_equal(per_isa[0][1], here.numpy().view(np.uint32), err_msg=f"{name} M={m}")


def test_iq4_types_take_the_portable_kernels(arm_build, kernel, tmp_path, monkeypatch):
    """IQ4_NL / IQ4_XS have no NEON kernels: every aarch64 set runs their portable kernels, which
    give this machine's portable bits (test_gguf_iq4.py checks those against a simulation)."""
    rng = np.random.default_rng(20)
    all_cases = []
    for name in ("IQ4_NL", "IQ4_XS"):
        elems = BLOCKS[type_id(name)][0]
        for m, n, blocks in SHAPES[::2]:
            x = (rng.standard_normal((m, blocks * elems)) * rng.uniform(0.1, 10)).astype(np.float32)
            all_cases.append((name, m, 1, random_blocks(name, n, blocks, rng).reshape(n, -1), x))
    _, results = run_driver(arm_build, "max", all_cases, tmp_path)
    monkeypatch.setenv("LMPLUG_GGUF_ISA", "generic")
    for (name, m, _, w, x), per_isa in zip(all_cases, results):
        here = kernel.mul_mat(torch.from_numpy(x), torch.from_numpy(w), type_id(name), x.shape[1], num_threads=1)
        for status, bits in per_isa:
            assert status == 0, name
            np.testing.assert_array_equal(bits, here.numpy().view(np.uint32), err_msg=f"{name} M={m}")


def included_files(cc: tuple[str, ...]) -> set[str]:
    """The files a build of gguf_cpu.c with ``cc`` reads (``cc -M``)."""
    deps = run_ok([*cc, "-M", *gguf_native.FLAGS, str(gguf_native.SOURCE)])
    return {Path(p).name for p in deps.replace("\\\n", " ").split()[1:]}


def test_each_machine_compiles_only_its_own_kernels(arm_build):
    """The aarch64 build reads gguf_neon.c and none of the x86 kernels; an x86-64 build the
    reverse (its NEON file is not even read: the next test)."""
    arm = included_files((CROSS_CC,))
    assert "gguf_neon.c" in arm and "gguf_avx512.c" not in arm


def test_each_type_runs_its_neon_and_dotprod_kernels(arm_build, tmp_path):
    """The products of every type reach that type's own NEON and dotprod kernels (not the
    portable fallback of a type without them): qemu's log of the code it ran names them. The
    driver and the source are linked statically here, so that qemu knows the kernels' names."""
    static = tmp_path / "driver-static"
    run_ok([CROSS_CC, *(f for f in gguf_native.FLAGS if f != "-shared"), "-static", "-o", str(static), str(DRIVER),
            str(gguf_native.SOURCE)])
    all_cases = [next(c for c in cases() if c[0] == name) for name in TYPES]
    write_cases(tmp_path / "cases", all_cases)
    run_ok([QEMU, "-cpu", "max", "-d", "in_asm", "-D", str(tmp_path / "log"), str(static), str(tmp_path / "cases"),
            str(tmp_path / "out")])
    ran = {line[4:].strip() for line in (tmp_path / "log").read_text().splitlines() if line.startswith("IN: ")}
    for name in TYPES:
        assert {f"{name.lower()}_neon", f"{name.lower()}_dotprod"} <= ran, name


def test_a_clang_build_keeps_the_portable_kernels(arm_build):
    """clang (14 tested) cannot compile the dotprod set into a build without it: its aarch64
    build (macOS's compiler) leaves gguf_neon.c out and still builds."""
    clang = shutil.which("clang") or shutil.which("clang-14")
    if clang is None:
        pytest.skip("no clang here: its aarch64 build is untested")
    assert "gguf_neon.c" not in included_files((clang, "--target=aarch64-linux-gnu"))
    run_ok([clang, "--target=aarch64-linux-gnu", *gguf_native.FLAGS, "-Werror", "-o", str(arm_build[1]) + ".clang",
            str(gguf_native.SOURCE)])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="checks the x86-64 build")
def test_the_x86_build_does_not_compile_the_neon_file():
    x86 = included_files(gguf_native.native_build.compiler())
    assert "gguf_avx512.c" in x86 and "gguf_neon.c" not in x86


def test_kernel_set_names_follow_the_machine(kernel, monkeypatch):
    """On aarch64 the C's kernel sets 1 and 2 are NEON and NEON + dotprod; Linux's "Features"
    line bounds them (a missing asimddp is named in the load's line); the dotprod set reads the
    rows as they are (no AVX-512 panels; copied into huge pages where they are on)."""
    assert gguf_native.kernel_sets("aarch64") == ("generic", "neon", "dotprod")
    assert gguf_native.kernel_sets("x86_64") == ("generic", "avx2", "avxvnni", "avx512")
    monkeypatch.setattr(gguf_native, "ISAS", gguf_native.kernel_sets("aarch64"))
    a53 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid\nCPU part\t: 0xd03"
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: a53)
    assert gguf_native.cpuinfo_isa("dotprod") == "neon"
    assert gguf_native.describe_isa("neon") == "NEON; dotprod needs asimddp"
    monkeypatch.setattr(gguf_native.native_build, "cpu_id", lambda: a53.replace("cpuid", "cpuid asimddp"))
    assert gguf_native.cpuinfo_isa("dotprod") == "dotprod"
    assert gguf_native.describe_isa("dotprod") == "NEON + dotprod (SDOT)"
    w = torch.from_numpy(random_blocks("Q4_0", 3, 2, np.random.default_rng(0)).reshape(3, -1))
    data, flagged = kernel.operand(w, type_id("Q4_0"), 64, 2)
    assert data.shape == w.shape and torch.equal(data, w) and flagged == type_id("Q4_0")  # rows (in huge pages)
