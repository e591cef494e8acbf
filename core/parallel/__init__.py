"""Tensor parallelism (Megatron-style) on ``torch.distributed``: gloo on CPUs, NCCL on GPUs.

``parallel: {tensor_parallel_size: N}`` splits every layer across N processes. Rank 0 is the
engine's own process: it schedules, builds each step's inputs, broadcasts them and samples;
ranks 1..N-1 are workers it spawns (``launch.py``) or that a ``torchrun`` launch started, which
run the same forward on their shard (``worker.py``). The split layers are in
``lmplug.models.parallel_layers`` (they are model layers; this package never imports the models
or the engine: ``setup.start`` is handed the engine's build callables); which slice of each
checkpoint tensor a rank reads is in ``sharding.py``. ``state.py`` holds the
rank, the world size and the collectives; TP=1 is the no-op default, so single-process code paths
are untouched.
"""

from lmplug.parallel.state import ParallelState, TensorParallelError, single

__all__ = ["ParallelState", "TensorParallelError", "single"]
