"""Tensor parallelism (Megatron-style) on ``torch.distributed``: gloo on CPUs, NCCL on GPUs.

``parallel: {tensor_parallel_size: N}`` splits every layer across N processes. Rank 0 is the
engine's own process: it schedules, builds each step's inputs, broadcasts them and samples;
ranks 1..N-1 are workers it spawns (``launch.py``) or that a ``torchrun`` launch started, which
run the same forward on their shard (``worker.py``). The split layers are in
``lmplug.kit.parallel_layers`` (they are model layers; this package never imports the models
or the engine: ``setup.start`` is handed the engine's build callables); which slice of each
checkpoint tensor a rank reads is in ``lmplug.kit.sharding``, and ``lmplug.kit.parallel`` holds the
rank, the world size and the collectives (both in the kit: architectures build on them); TP=1 is the no-op default, so single-process code paths
are untouched.

``parallel: {pipeline_parallel_size: P}`` splits the layers into P stages of T ranks each
(``pipeline.py``: the stage plan and its checks); a stage's layers, its transport of hidden states
and logits (point-to-point) and its clock are ``lmplug.kit.pipeline``.
"""

from lmplug.kit.parallel import ParallelState, TensorParallelError, single

__all__ = ["ParallelState", "TensorParallelError", "single"]
