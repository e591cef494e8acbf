"""Build everything an engine runs from a resolved config: model, KV cache, backends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from lmplug.config import ResolvedConfig
from lmplug.errors import ConfigError
from lmplug.engine.runner import ModelRunner
from lmplug.interfaces import KVCacheBackend, KVCacheSpec, Scheduler, SchedulerLimits
from lmplug.loading import open_source
from lmplug.loading.weights import load_weights
from lmplug.models import ModelConfig, architecture_for
from lmplug.models.layers import Unquantized

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    model_config: ModelConfig
    model: torch.nn.Module
    tokenizer: object | None
    kv: KVCacheBackend
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    eos_token_ids: frozenset[int]
    load_time_s: float


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def pick_dtype(name: str, device: str) -> str:
    # On CPUs fp32 matmuls are the fast path; GPUs get the checkpoint's half precision.
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return name


def build_engine_parts(resolved: ResolvedConfig) -> EngineParts:
    from lmplug.loading.cache import resolve_model

    cfg = resolved.config
    started = time.perf_counter()
    source = open_source(resolve_model(cfg.model))
    # an unsupported architecture is the error to report, not the config keys it lacks
    arch = architecture_for(source.hf_config.get("model_type"))
    model_config = ModelConfig.from_hf(source.hf_config)
    dtype = DTYPES[resolved.dtype]
    device = torch.device(resolved.device)
    max_model_len = cfg.max_model_len or model_config.max_position_embeddings
    backends = resolved.backends

    _check_window_support(model_config, backends["attention"])
    attention = backends["attention"].cls(
        backends["attention"].options, num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
        scale=model_config.head_dim ** -0.5, sliding_window=model_config.sliding_window)
    quant = Unquantized()
    with torch.device(device):
        model = arch(model_config, dtype, quant, attention, max_model_len)
    _load_with_progress(model, source)
    model.eval()

    sched_opts = backends["scheduler"].options
    spec = KVCacheSpec(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                       head_dim=model_config.head_dim, dtype=dtype, device=device,
                       max_model_len=max_model_len, max_num_seqs=sched_opts.max_num_seqs,
                       sliding_window=model_config.sliding_window)
    kv = backends["kvcache"].cls(backends["kvcache"].options, spec)
    limits = SchedulerLimits(sched_opts.max_num_seqs, sched_opts.max_num_batched_tokens, max_model_len)
    scheduler = backends["scheduler"].cls(sched_opts, kv, limits)
    runner = ModelRunner(model, kv, device)
    load_time = time.perf_counter() - started
    logger.info("loaded %s (%s, %d layers) in %.2f s; KV: %s, %d bytes/token", source.path,
                model_config.model_type, model_config.num_layers, load_time, kv.name, kv.bytes_per_token)
    return EngineParts(model_config, model, source.tokenizer, kv, scheduler, runner, max_model_len,
                       _eos_ids(source), load_time)


def _check_window_support(model_config: ModelConfig, attention) -> None:
    if model_config.sliding_window and "sliding_window" not in attention.cls.capabilities.features:
        raise ConfigError(f"attention: backend {attention.name!r} does not support sliding-window "
                          f"attention, which this {model_config.model_type} model uses "
                          f"(window {model_config.sliding_window}); choose one that lists the "
                          "'sliding_window' feature (`lmplug plugins`)")


def _load_with_progress(model: torch.nn.Module, source) -> None:
    from tqdm import tqdm

    # tqdm waits `delay` seconds before drawing, so fast loads stay quiet.
    with tqdm(total=len(source.tensor_names), desc="loading weights", unit="tensor", delay=2.0,
              leave=False) as bar:
        load_weights(model, source, progress=bar)


def _eos_ids(source) -> frozenset[int]:
    ids: set[int] = set()
    for value in (source.generation_config.get("eos_token_id"), source.hf_config.get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if source.tokenizer is not None:
        ids.update(source.tokenizer.eos_token_ids)
    return frozenset(ids)
