"""What the engine build asks of tensor and pipeline parallelism: checks, start-up, KV agreement, memory.

- ``check_model``: N must divide the attention heads and the intermediate sizes; the KV heads
  are split when N divides them and replicated when N is a multiple of them (a clear
  ``ConfigError`` naming ``parallel.tensor_parallel_size`` and the model's numbers otherwise).
  Under ``parallel.expert_parallel`` N must divide the number of routed experts instead of
  their width (each rank holds whole experts).
- ``start``: rank 0 spawns the workers (``WorkerGroup``; P x T ranks under pipeline parallelism,
  the stages' layers from ``pipeline.layer_counts``) or joins a ``torchrun`` launch; the engine hands
  it its ``peek`` and ``build`` callables (this package never imports the engine).
- ``build_kv``: every rank's KV cache gets rank 0's block count (rank 0's scheduler hands out
  block ids, so each worker's pool must hold as many blocks; it holds only its KV heads). Rank 0's
  cache records the copies it makes itself (copy-on-write blocks, forked rows: the "tp_copies"
  feature) and each step's message carries them to the workers, which repeat them first.
- ``memory_report``: weight bytes (and the routed MoE experts' part of them) and KV bytes per
  token of every rank.
"""

from __future__ import annotations

import logging

import torch

from lmplug.errors import ConfigError
from lmplug.kit import kv_extras
from lmplug.kit.parallel import ParallelState

logger = logging.getLogger(__name__)

OPTION = "parallel.tensor_parallel_size"
EP_OPTION = "parallel.expert_parallel"


def check_model(model_config, n: int, where: str, expert_parallel: bool = False) -> None:
    """Raise ``ConfigError`` when the model cannot be split across ``n`` ranks (with whole
    experts per rank under ``expert_parallel``)."""
    if n == 1:
        return
    name = f"{where} ({model_config.model_type})"
    if model_config.mla is not None:
        raise ConfigError(f"{OPTION}={n}: {name} uses multi-head latent attention (DeepSeek MLA), which "
                          "tensor parallelism does not split yet; use tensor_parallel_size 1")
    moe = model_config.moe
    if moe is not None:
        widths = [(moe.shared_intermediate_size, "shared_expert_intermediate_size")]
        if expert_parallel:
            if moe.num_experts % n:
                raise ConfigError(f"{EP_OPTION}: {OPTION}={n} does not divide the {moe.num_experts} routed "
                                  f"experts of {name}; each rank holds whole experts, so choose a divisor of "
                                  f"{moe.num_experts} or set expert_parallel to false (every expert split "
                                  "by its width)")
        else:
            widths.insert(0, (moe.intermediate_size, "the routed experts' intermediate size"))
        for size, key in widths:
            if size % n:
                raise ConfigError(f"{OPTION}={n} does not divide the expert width {size} of {name} ({key})")
    heads, kv, inter = model_config.num_heads, model_config.num_kv_heads, model_config.intermediate_size
    if heads % n:
        raise ConfigError(f"{OPTION}={n} does not divide the {heads} attention heads of {name} "
                          f"(num_attention_heads); choose a divisor of {heads}")
    if kv % n and n % kv:
        raise ConfigError(f"{OPTION}={n} neither divides the {kv} KV heads of {name} (num_key_value_heads) "
                          f"nor is a multiple of them (then each KV head is replicated)")
    if inter % n:
        raise ConfigError(f"{OPTION}={n} does not divide the intermediate size {inter} of {name} "
                          "(intermediate_size)")


# drafters that work through a pipeline: they read tokens, not the target's layers or hidden states
PIPELINE_DRAFTERS = ("ngram", "draft_model")


def check_config(resolved) -> None:
    n, pp = resolved.config.parallel.tensor_parallel_size, resolved.config.parallel.pipeline_parallel_size
    drafter = resolved.backends.get("speculative")
    if pp > 1 and drafter is not None and drafter.name not in PIPELINE_DRAFTERS:
        raise ConfigError(f"{resolved.source}: parallel.pipeline_parallel_size={pp} with speculative "
                          f"{drafter.name!r}: it reads the target's hidden states or runs its layers, which "
                          f"live on other stages; use one of {', '.join(PIPELINE_DRAFTERS)} or one stage")
    if resolved.device == "cuda" and torch.cuda.device_count() < n * pp:
        raise ConfigError(f"{resolved.source}: {OPTION}={n} x parallel.pipeline_parallel_size={pp} needs "
                          f"{n * pp} GPUs, this machine has {torch.cuda.device_count()}")
    if n == 1:
        return
    if resolved.config.speculative is not None:
        raise ConfigError(f"{resolved.source}: {OPTION}={n} with speculative decoding is not supported "
                          "yet; remove the `speculative` section or use tensor_parallel_size 1")


def start(resolved, peek, build):
    """Rank 0's ``WorkerGroup`` (workers spawned, or the ranks of a torchrun launch joined).
    A torchrun rank other than 0 serves rank 0's steps here and exits when it stops.

    The engine hands in what this package must not import: ``peek(resolved) -> (ModelConfig,
    where)`` reads the model's config without its weights (checked here, before any worker
    starts); ``build(resolved, parallel=state) -> parts`` builds a rank's engine parts (a
    module-level function: it travels to the spawned workers by reference)."""
    from lmplug.parallel.group import init_rank, rank_layout
    from lmplug.parallel.launch import WorkerGroup, torchrun_rank
    from lmplug.parallel.pipeline import layer_counts
    from lmplug.parallel.worker import serve

    cfg = resolved.config
    n, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    rank = torchrun_rank(n, pp)  # sizes against WORLD_SIZE first: nothing else is read before
    check_config(resolved)
    model_config, where = peek(resolved)
    check_model(model_config, n, where, cfg.parallel.expert_parallel)
    backend = "nccl" if resolved.device == "cuda" else "gloo"
    payload = {"config": cfg.model_dump(), "device": resolved.device, "dtype": resolved.dtype,
               "source": resolved.source, "build": build,
               "pipeline": layer_counts(model_config.num_layers, pp, cfg.parallel.pipeline_layers, where)
               if pp > 1 else None}
    if rank is None:
        return WorkerGroup(payload, n * pp, backend, cfg.parallel.timeout_s)
    state = init_rank(rank, n * pp, None, backend, cfg.parallel.timeout_s, **rank_layout(payload))
    if rank != 0:
        serve(state, payload)
        raise SystemExit(0)
    return WorkerGroup.joined(state)


def local_kv_shape(kv_shape: dict, parallel: ParallelState) -> dict:
    """The KV heads this rank stores."""
    if not parallel.is_parallel:
        return kv_shape
    local = {**kv_shape, "num_kv_heads": parallel.kv_heads(kv_shape["num_kv_heads"])[1]}
    if "layer_shapes" in kv_shape:
        local["layer_shapes"] = tuple((parallel.kv_heads(h)[1], d) for h, d in kv_shape["layer_shapes"])
    return local


def build_kv(cls, options, spec, parallel: ParallelState):
    if not parallel.is_distributed:
        return cls(options, spec)
    kv = cls(options, spec) if parallel.global_rank == 0 else None
    blocks = parallel.broadcast_object(None if kv is None else kv_extras.pool_blocks(kv))
    if kv is None:
        if blocks is not None:
            options = kv_extras.with_pool_blocks(cls, options, blocks)
        return cls(options, spec)
    if "tp_copies" in kv.capabilities.features:
        kv.record_copies()
    return kv


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # tied weights once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the routed MoE experts (``ExpertWeights``, stacked or packed) this rank holds."""
    return sum(weight_bytes(m) for m in model.modules() if callable(getattr(m, "experts_args", None)))


def memory_report(model: torch.nn.Module, kv, parallel: ParallelState) -> dict:
    """Per rank: weight bytes (parameters and buffers; of which routed MoE experts) and KV bytes
    per token."""
    mine = {"weight_bytes": weight_bytes(model), "expert_bytes": expert_bytes(model),
            "kv_bytes_per_token": int(kv.bytes_per_token)}
    ranks = parallel.all_gather_object(mine)
    report = {"tensor_parallel_size": parallel.world_size, "pipeline_parallel_size": parallel.stage.num_stages,
              "expert_parallel": parallel.expert_parallel,
              "weight_bytes_per_rank": [r["weight_bytes"] for r in ranks],
              "expert_bytes_per_rank": [r["expert_bytes"] for r in ranks],
              "kv_bytes_per_token_per_rank": [r["kv_bytes_per_token"] for r in ranks]}
    if parallel.is_distributed and parallel.global_rank == 0:
        logger.info("tensor parallel%s: weights per rank %s bytes (MoE experts %s), KV per rank %s bytes/token",
                    " (expert parallel)" if parallel.expert_parallel else "", report["weight_bytes_per_rank"],
                    report["expert_bytes_per_rank"], report["kv_bytes_per_token_per_rank"])
    return report
