"""CPU threads: torch's small ops on one thread during small steps, products on all of them.

At batch 1 a decode step on the CPU is a few hundred small ops (norms, RoPE, attention over a
few KV heads, KV writes) between the matrix products. torch splits some of them across its
intra-op threads, and on a machine with few cores those threads then wait on each other and
compete for the cores with the threads of a kernel's own pool (the GGUF products': an idle
worker there spins a little before it sleeps). The same holds in a prefill, whose torch ops
(attention over a short prompt, norms, RoPE) are small beside its products: after each of them
torch's OpenMP workers spin on the cores the products' threads need. The engine therefore runs
a whole step (forward, sampling, commit) of few tokens, or a prefill with little attention
(``ModelRunner.threads_for``), inside ``small_ops_single_threaded()`` when the model's quant
method says its products split across threads of their own (``lmplug.kit.extras.OwnThreads``):
torch gets one thread, and ``compute_threads()`` still answers the thread count set before,
which such kernels read instead of ``torch.get_num_threads()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

# per Python thread, as torch's own count is (OpenMP's thread count is the calling thread's):
# the count torch had when this thread's region opened; 0 outside one
_local = threading.local()


def compute_threads() -> int:
    """The threads a CPU kernel may split one product across: ``torch.get_num_threads()``, or
    inside ``small_ops_single_threaded`` the count torch had before it (this thread's)."""
    return getattr(_local, "threads", 0) or torch.get_num_threads()


@contextlib.contextmanager
def small_ops_single_threaded() -> Iterator[None]:
    """torch's intra-op threads at 1 for the block, in the calling thread (a nested block is
    part of the outer one), restored when it ends."""
    if getattr(_local, "threads", 0):
        yield
        return
    threads = torch.get_num_threads()
    _local.threads = threads
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
        _local.threads = 0
