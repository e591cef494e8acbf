"""The native LoRA update alone (``lmplug_adapter.lora_native``'s ``lora_add``, no base product):
CPU time of one decode step's updates over the demo model's adapted layers, per slot dtype.

    python benchmarks/bench_lora_native.py [--rows 16] [--slots 16] [--rank 8] [--layers 30] [--repeats 7]
                                           [--threads 1]

Each of ``--layers`` layers in SmolLM2-135M's shape has its four adapted products (q/k/v fused,
o, gate/up fused, down), ``--slots`` random adapters of rank ``--rank`` on each, the step's
``--rows`` rows spread round-robin over the slots (16 over 16: every row reads its own adapter,
what ``bench_lora.py``'s ``lora x16`` pays beside the base product). The float32, float16 and
bfloat16 slots run in interleaved rounds in one process, one thread, the median of each; the
figure is this process's CPU time (a shared machine: the load average is printed). With
``--threads N`` (N > 1) each dtype also runs on N threads of the GGUF kernels' pool (the one the
engine's LoRA products share, ``NativeCall.parallel_for``), interleaved with its one-thread run,
both timed by the wall clock (CPU time would count the pool's spinning), the median and the best of each.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

SHAPES = [({"q": 576, "k": 192, "v": 192}, 576), ({"o": 576}, 576), ({"gate": 1536, "up": 1536}, 576),
          ({"down": 576}, 1536)]
DTYPES = ("float32", "float16", "bfloat16")


def layers(dtype: torch.dtype, a, parallel_for: int | None) -> list:
    """(context, what it points into, x, out) of every adapted product, its slots filled."""
    from lmplug_adapter import lora_native
    from lmplug_adapter.torch_lora import TorchLoRA

    from lmplug.interfaces.adapter import AdapterOptions
    from lmplug.interfaces.quant import Unquantized
    from lmplug.kit.layers import Linear
    from lmplug.kit.lora import LinearLoRA, LoRAStep

    lib, g, out = lora_native.load(), torch.Generator().manual_seed(0), []
    for _ in range(a.layers):
        for shards, d_in in SHAPES:
            linear = Linear(d_in, shards, bias=False, dtype=torch.float32, quant=Unquantized())
            step = LoRAStep(TorchLoRA(AdapterOptions(max_loras=a.slots, max_lora_rank=a.rank)))
            lora = LinearLoRA(linear, list(shards), step, a.slots, a.rank)
            for s in range(a.slots):
                lora.fill(s, {k: (torch.randn(a.rank, d_in, generator=g).to(dtype),
                                  torch.randn(n, a.rank, generator=g).to(dtype), 2.0)
                              for k, n in enumerate(shards.values())})
            step.set([t % a.slots for t in range(a.rows)], torch.device("cpu"))
            ctx, keep = lora_native.context(lora, None, lib, parallel_for)
            out.append((ctx, (keep, lora), torch.randn(a.rows, d_in), torch.zeros(a.rows, lora.out_features)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    from lmplug_adapter import lora_native

    torch.set_num_threads(1)
    print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}  (a shared machine: other jobs run)")
    lib = lora_native.load()
    print(f"kernel set: {lora_native.ISAS[lora_native.isa(lib)]}")
    parallel_for = None
    if a.threads > 1:
        from lmplug_quant import gguf_native

        parallel_for = gguf_native.load().parallel_for
    clock = time.perf_counter if a.threads > 1 else time.process_time
    counts = sorted({1, a.threads})
    sets = {name: layers(getattr(torch, name), a, parallel_for) for name in DTYPES}
    runs: dict[tuple[str, int], list[float]] = {(name, n): [] for name in DTYPES for n in counts}
    for _ in range(a.repeats):
        for (name, threads), spent in runs.items():
            started = clock()
            for ctx, _keep, x, y in sets[name]:
                if lib.lora_add(ctypes.addressof(ctx), x.data_ptr(), a.rows, y.data_ptr(), threads):
                    raise RuntimeError("lora_add failed")
            spent.append(clock() - started)
    f32 = statistics.median(runs["float32", 1])
    print(f"clock: {'wall' if a.threads > 1 else 'process CPU'}")
    for (name, threads), spent in runs.items():
        med = statistics.median(spent)
        print(f"{name:<9} {threads} thread(s) {med * 1e3:7.2f} ms per step, best {min(spent) * 1e3:6.2f} "
              f"({f32 / med:4.2f}x float32's one-thread speed; {', '.join(f'{s * 1e3:.1f}' for s in spent)})")
    print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
