"""Where a batch-1 decode token goes on the CPU: ATen calls, the share outside the kernels, top ops.

    OMP_NUM_THREADS=1 python benchmarks/profile_decode.py [--config FILE] [--set KEY=VALUE ...]
        [--steps 32] [--threads 1 2] [--top 15] [--compare-fused]

One request (a 32-token prompt, greedy, EOS ignored) runs through ``LLMEngine.step`` with the
default config (the demo model on the CPU) or ``--config`` / ``--set`` (as ``lmplug generate``
takes them). After the prefill and a few warm-up steps, for each thread count: ``--steps`` decode
steps timed without the profiler (tokens/s, wall and process CPU ms per token: on a
loaded machine the CPU time moves less than the wall time), then the same number under
``torch.profiler``. From the profile, per token: the ATen calls (every ``aten::`` event, nested
ones included, and the top-level ones), and the time inside the kernels, matrix products
(``aten::mm`` / ``addmm`` / ``bmm`` / the packed int GEMMs / the GGUF kernel, its bound products
timed through a ``record_function`` put around them here, self time) and attention (the
attention backend's C kernel, timed through a ``record_function`` put around it here, and
torch's SDPA kernels), plus the native decode step (``lmplug.kit.native_step``: every decoder
layer in one C call, products, attention and the fused ops inside, timed through a
``record_function`` too; ``LMPLUG_NATIVE_STEP=0`` measures the per-layer path). "Outside the
kernels" is one minus kernel time over the *unprofiled* ms per token (the profiler slows the
Python and dispatch between ops, not the kernels). "host": the unprofiled wall time less the
time inside those C calls (``perf_counter`` around each): a step's Python and torch ops, per token.

``--phases RUNS`` (at 2 threads or more): RUNS more unprofiled measurements, each between two
read-bandwidth probes, reported per bandwidth phase as ``bench_vs_llamacpp.py --phases`` groups
them (a VM's multi-thread bandwidth can move between levels within seconds).

``--compare-fused`` repeats every measurement with the fused CPU ops off
(as ``LMPLUG_FUSED_CPU=0`` does; ``lmplug.kit.fused_cpu.set_enabled``), in the same process, so that
the two columns see the same machine load. The load average is printed before and after:
timings on a shared machine move with it; compare within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections import Counter

import torch

# self time of these ops is "matrix product" time (float, packed-int and low-precision GEMMs)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm",
              "aten::_weight_int4pack_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
              "aten::_scaled_mm", "aten::mkldnn_linear", "lmplug_quant::gguf_mul_mat", "native::gguf_mul_mat")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_flash_attention_forward",
                 "native::attention_decode")
# the native decode step (lmplug.kit.native_step): every decoder layer in one C call
STEP_OPS = ("native::decode_step",)
PROMPT = list(range(100, 132))


def build_llm(args: argparse.Namespace):
    from lmplug import LLM
    from lmplug.cli import _overrides

    overrides = _overrides(argparse.Namespace(set=args.set, model=args.model))
    return LLM(config=args.config, **overrides)


C_SECONDS = [0.0]  # wall seconds inside the C calls wrapped below (the native step, products, attention)


@contextlib.contextmanager
def in_c():
    start = time.perf_counter()
    try:
        yield
    finally:
        C_SECONDS[0] += time.perf_counter() - start


def time_native_calls() -> None:
    """Wrap the C kernels the profiler cannot see (ctypes calls) in a ``record_function`` each,
    so their time counts as kernel time: the paged backend's decode kernel, and the GGUF
    layers' bound products (``gguf_native.BoundProduct``: the eager hot path calls them directly,
    not through the registered op)."""
    import importlib

    for module, cls, method, label in (("lmplug_attention.paged.native", "NativeKernel", "decode",
                                        "native::attention_decode"),
                                       ("lmplug_quant.gguf_native", "BoundProduct", "__call__",
                                        "native::gguf_mul_mat")):
        try:
            owner = getattr(importlib.import_module(module), cls)
        except ImportError:
            continue
        original = getattr(owner, method)

        def timed(self, *a, _original=original, _label=label, **kw):
            with torch.profiler.record_function(_label), in_c():
                return _original(self, *a, **kw)

        setattr(owner, method, timed)

    from lmplug.kit import fused_cpu

    library = fused_cpu.library

    class TimedLibrary:
        """The fused ops' library, its ``decode_step_f32`` (the native decode step) timed."""

        def __init__(self, lib) -> None:
            self._lib = lib

        def __getattr__(self, name: str):
            return getattr(self._lib, name)

        def decode_step_f32(self, *args):
            with torch.profiler.record_function("native::decode_step"), in_c():
                return self._lib.decode_step_f32(*args)

    def timed_library():
        lib = library()
        return None if lib is None else TimedLibrary(lib)

    fused_cpu.library = timed_library


class Decoder:
    """One running request on an engine, stepped one decode token at a time."""

    def __init__(self, llm, steps: int) -> None:
        from lmplug import SamplingParams

        self.engine = llm.engine
        self.steps = steps
        # enough tokens for every measurement below, one request for them all
        params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
        limit = self.engine.max_model_len - len(PROMPT) - 1
        self.budget = limit
        self.engine.add_request("profile", PROMPT, params)
        self.engine.step()  # the prefill and first token
        self.used = 0

    def step(self, n: int) -> None:
        if self.used + n > self.budget:
            raise SystemExit(f"profile_decode: the request ran past max_model_len "
                             f"({self.engine.max_model_len}); use fewer --steps")
        for _ in range(n):
            self.engine.step()
        self.used += n

    def timed(self, repeats: int = 3) -> tuple[float, float, float]:
        """Medians over ``repeats`` runs of ``steps`` steps: wall and process CPU ms per token, and
        the host's ms per token (wall less the time inside the wrapped C calls: Python, torch ops)."""
        walls, cpus, hosts = [], [], []
        for _ in range(repeats):
            start, cpu, in_kernels = time.perf_counter(), time.process_time(), C_SECONDS[0]
            self.step(self.steps)
            walls.append((time.perf_counter() - start) * 1e3 / self.steps)
            cpus.append((time.process_time() - cpu) * 1e3 / self.steps)
            hosts.append(walls[-1] - (C_SECONDS[0] - in_kernels) * 1e3 / self.steps)
        return statistics.median(walls), statistics.median(cpus), statistics.median(hosts)

    def profiled(self):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            self.step(self.steps)
            wall = (time.perf_counter() - start) * 1e3 / self.steps
        return prof, wall


def analyse(prof, steps: int, wall_ms: float, cpu_ms: float, host_ms: float, profiled_ms: float, top: int) -> dict:
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top_level = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    self_us = Counter()
    calls = Counter()
    for e in events:
        self_us[e.name] += e.self_cpu_time_total
        calls[e.name] += 1
    matmul = sum(self_us[n] for n in MATMUL_OPS) / 1e3 / steps
    attention = sum(self_us[n] for n in ATTENTION_OPS) / 1e3 / steps
    step = sum(self_us[n] for n in STEP_OPS) / 1e3 / steps
    ops = sorted(((us / 1e3 / steps, calls[n] / steps, n) for n, us in self_us.items()
                  if not n.startswith("ProfilerStep")), reverse=True)[:top]
    return {"aten": len(aten) / steps, "top_level": len(top_level) / steps, "matmul": matmul,
            "attention": attention, "step": step, "wall": wall_ms, "cpu": cpu_ms, "host": host_ms,
            "profiled": profiled_ms,
            "outside": 1 - (matmul + attention + step) / wall_ms, "ops": ops}


def phases(decoder: Decoder, threads: int, repeats: int) -> None:
    """``--phases``: ``repeats`` unprofiled runs of ``--steps`` steps, each between two read-bandwidth
    probes at ``threads`` threads, grouped by the phase the probes found (bench_vs_llamacpp's rule:
    high at 1.4 times a one-thread probe or more, both probes); per phase the medians of wall, C
    calls and host ms per token."""
    import bench_vs_llamacpp
    from read_bandwidth import Probe

    torch.set_num_threads(threads)
    threshold = bench_vs_llamacpp.phase_threshold()
    probe = Probe(threads)
    runs: dict[str, list[tuple[float, float, float]]] = {"high": [], "low": [], "mixed": []}
    for _ in range(repeats):
        before = probe()
        start, in_kernels = time.perf_counter(), C_SECONDS[0]
        decoder.step(decoder.steps)
        wall = (time.perf_counter() - start) * 1e3 / decoder.steps
        c_ms = (C_SECONDS[0] - in_kernels) * 1e3 / decoder.steps
        pair = [before, probe()]
        runs[bench_vs_llamacpp.phase_of(pair, threshold)].append((wall, c_ms, sum(pair) / 2))
    for phase, got in runs.items():
        if not got:
            continue
        wall, c_ms, gbs = (statistics.median(x[i] for x in got) for i in range(3))
        print(f"  {phase} phase (threshold {threshold:.0f} GB/s; {len(got)} of {repeats} runs; probes {gbs:.1f} GB/s): "
              f"{1e3 / wall:6.1f} tok/s  {wall:6.2f} ms/token  in the C calls {c_ms:6.2f} ms  host {wall - c_ms:5.2f} ms")


def measure(decoder: Decoder, threads: int, top: int) -> dict:
    torch.set_num_threads(threads)
    decoder.step(4)  # settle after a change of threads / path
    wall, cpu, host = decoder.timed()
    prof, profiled = decoder.profiled()
    return analyse(prof, decoder.steps, wall, cpu, host, profiled, top)


def report(label: str, r: dict, show_ops: bool) -> None:
    print(f"  {label}: {1e3 / r['wall']:6.1f} tok/s  {r['wall']:6.2f} ms/token (CPU {r['cpu']:6.2f} ms)  "
          f"ATen calls/token {r['aten']:7.0f} (top-level {r['top_level']:5.0f})  "
          f"matmul {r['matmul']:5.2f} ms  attention {r['attention']:5.2f} ms  native step {r['step']:5.2f} ms  "
          f"outside kernels {100 * r['outside']:4.1f}%  (profiled {r['profiled']:.2f} ms/token)\n"
          f"    host (unprofiled wall less the C calls: Python and torch ops) {r['host']:5.2f} ms/token")
    if show_ops:
        print(f"    {'self ms/token':>13s} {'calls/token':>11s}  op")
        for ms, n, name in r["ops"]:
            print(f"    {ms:13.3f} {n:11.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file (default: the embedded default config)")
    parser.add_argument("--model", help="model name or path (default: the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as `lmplug generate --set` (repeatable)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--top", type=int, default=15, help="top ops by self time to list")
    parser.add_argument("--phases", type=int, default=0, metavar="RUNS",
                        help="at 2 threads or more, also RUNS unprofiled runs between read-bandwidth probes, "
                        "reported per bandwidth phase (bench_vs_llamacpp.py --phases)")
    parser.add_argument("--compare-fused", action="store_true",
                        help="also measure with the fused CPU ops off (LMPLUG_FUSED_CPU=0), same process")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  "
          f"(cores: {os.cpu_count()})")
    time_native_calls()
    from lmplug.kit import fused_cpu

    llm = build_llm(args)
    resolved = llm.engine.resolved
    print(f"model {resolved.config.model}, dtype {resolved.dtype}, device {resolved.device}, "
          f"attention {resolved.backends['attention'].name}, torch {torch.__version__}")
    decoder = Decoder(llm, args.steps)
    decoder.step(8)  # warm-up: first-call costs (kernel builds, compiled graphs, allocator)
    paths = [("fused", True), ("unfused", False)] if args.compare_fused else [(None, None)]
    for threads in args.threads:
        print(f"\n{threads} thread(s), {args.steps} decode steps per measurement:")
        for label, fused in paths:
            if fused is not None:
                fused_cpu.set_enabled(fused)
            r = measure(decoder, threads, args.top)
            report(label or "decode", r, show_ops=True)
            if args.phases and threads >= 2:
                phases(decoder, threads, args.phases)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
