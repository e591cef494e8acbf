"""Build everything an engine runs from a resolved config: model, KV cache, backends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from lmplug.config import ResolvedBackend, ResolvedConfig, check_kv_dtype, resolve_section
from lmplug.engine.runner import ModelRunner
from lmplug.errors import ConfigError, ModelLoadError, PluginError
from lmplug.interfaces import (
    Drafter,
    DraftTarget,
    KVCacheBackend,
    KVCacheSpec,
    MoEBackend,
    QuantMethod,
    Scheduler,
    SchedulerLimits,
)
from lmplug.loading import open_source
from lmplug.loading.weights import load_weights
from lmplug.models import ModelConfig, architecture_for
from lmplug.models.layers import Unquantized
from lmplug.parallel import ParallelState
from lmplug.parallel import setup as parallel_setup
from lmplug.parallel import single as single_parallel
from lmplug.parallel import use as use_parallel
from lmplug.plugins import get_registry

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
    drafter: Drafter | None = None  # speculative decoding, when configured
    # weight bytes and KV bytes per token of every tensor-parallel rank (``parallel.setup``)
    memory: dict | None = None


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def pick_dtype(name: str, device: str) -> str:
    # On CPUs fp32 matmuls are the fast path; GPUs get the checkpoint's half precision.
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return name


def peek_model_config(resolved: ResolvedConfig) -> tuple[ModelConfig, str]:
    """The model's config (and its path) without loading weights."""
    from lmplug.loading.cache import resolve_model

    source = open_source(resolve_model(resolved.config.model))
    architecture_for(source.hf_config.get("model_type"))
    return ModelConfig.from_hf(source.hf_config), str(source.path)


def build_engine_parts(resolved: ResolvedConfig, parallel: ParallelState | None = None) -> EngineParts:
    """``parallel``: this process's rank of a tensor-parallel group (None: one process); the
    model and KV cache are then built with this rank's heads, slices and KV heads."""
    from lmplug.loading.cache import resolve_model

    cfg = resolved.config
    parallel = parallel or single_parallel()
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
    kv_shape, scale = _attention_kv_shape(resolved, model_config)
    parallel_setup.check_model(model_config, parallel.world_size, str(source.path), parallel.expert_parallel)
    kv_shape = parallel_setup.local_kv_shape(kv_shape, parallel)  # this rank's KV heads
    check_kv_dtype(backends, resolved.source)  # again: an MLA model may have swapped the backend
    attention = backends["attention"].cls(
        backends["attention"].options, num_heads=model_config.num_heads // parallel.world_size,
        num_kv_heads=kv_shape["num_kv_heads"], head_dim=kv_shape["head_dim"],
        scale=scale, sliding_window=model_config.sliding_window)
    drafter = None
    if "speculative" in backends:
        drafter = backends["speculative"].cls(backends["speculative"].options)
        _check_tree_support(drafter, backends, attention, device, parallel)
    quant = _quant_method(resolved, source)
    moe = _moe_backend(resolved, model_config)
    extra = {"moe": moe} if moe is not None else {}
    with torch.device(device), use_parallel(parallel):
        model = arch(model_config, dtype, quant, attention, max_model_len, **extra)
    _load_with_progress(model, source, parallel)
    model.eval()

    sched_opts = backends["scheduler"].options
    spec = KVCacheSpec(num_layers=model_config.num_layers, **kv_shape, dtype=dtype, device=device,
                       max_model_len=max_model_len, max_num_seqs=sched_opts.max_num_seqs,
                       sliding_window=model_config.sliding_window,
                       max_num_batched_tokens=sched_opts.max_num_batched_tokens)
    kv = parallel_setup.build_kv(backends["kvcache"].cls, backends["kvcache"].options, spec, parallel)
    limits = SchedulerLimits(sched_opts.max_num_seqs, sched_opts.max_num_batched_tokens, max_model_len)
    scheduler = backends["scheduler"].cls(sched_opts, kv, limits)
    runner = ModelRunner(model, kv, device)
    if drafter is not None:
        drafter.setup(DraftTarget(model, model_config, kv, source.tokenizer, device, dtype,
                                  max_model_len, sched_opts.max_num_seqs))
    load_time = time.perf_counter() - started
    logger.info("loaded %s (%s, %d layers) in %.2f s; KV: %s (%s), %d bytes/token", source.path,
                model_config.model_type, model_config.num_layers, load_time, kv.name,
                kv.spec.kv_dtype if kv.spec.quantized else resolved.dtype, kv.bytes_per_token)
    memory = parallel_setup.memory_report(model, kv, parallel)
    return EngineParts(model_config, model, source.tokenizer, kv, scheduler, runner, max_model_len,
                       _eos_ids(source), load_time, drafter, memory=memory)


def _check_window_support(model_config: ModelConfig, attention) -> None:
    if model_config.sliding_window and "sliding_window" not in attention.cls.capabilities.features:
        raise ConfigError(f"attention: backend {attention.name!r} does not support sliding-window "
                          f"attention, which this {model_config.model_type} model uses "
                          f"(window {model_config.sliding_window}); choose one that lists the "
                          "'sliding_window' feature (`lmplug plugins`)")


def _check_tree_support(drafter, backends: dict, attention, device: torch.device,
                        parallel: ParallelState) -> None:
    """A drafter that proposes trees needs tree attention (the "tree_attention" feature, and the
    instance's ``supports_tree_attention(device)`` where it has one) and one process: the
    accepted path's K/V is moved in this process's cache."""
    if not drafter.drafts_trees:
        return
    chosen = backends["attention"]
    narrow = getattr(attention, "supports_tree_attention", None)
    if "tree_attention" not in chosen.cls.capabilities.features or (narrow is not None and not narrow(device)):
        how = ("its Triton kernels have no tree mask; use `attention: {backend: paged, kernels: torch}` or sdpa"
               if narrow is not None else "choose one that lists the 'tree_attention' feature (sdpa, paged)")
        raise ConfigError(f"speculative: {drafter.name}: tree candidates (option `tree`) need tree attention, "
                          f"which attention backend {chosen.name!r} (plugin {chosen.info.plugin}) on "
                          f"{device.type} does not provide: {how}; or drop `speculative.tree` to draft a chain")
    if parallel.world_size > 1:
        raise ConfigError(f"speculative: {drafter.name}: tree candidates (option `tree`) are not supported "
                          "with tensor parallelism; drop `speculative.tree` to draft a chain")


def _attention_kv_shape(resolved: ResolvedConfig, model_config: ModelConfig) -> tuple[dict, float]:
    """What the KV cache stores per token (``KVCacheSpec`` fields) and the softmax scale.

    Checks first that the attention backend fits the model: an MLA model (DeepSeek-V2/V3) needs
    a backend listing the "mla" feature (`auto` becomes `mla`), and such a backend runs MLA
    models only. MLA caches one latent row per token and layer (``num_kv_heads`` 1, ``head_dim``
    = kv_lora_rank + rope dims, no V)."""
    chosen = resolved.backends["attention"]
    mla = model_config.mla
    if mla is not None and "mla" not in chosen.cls.capabilities.features \
            and (resolved.config.attention or {}).get("backend", "auto") == "auto":
        config = resolved.config.model_copy(update={"attention": {"backend": "mla"}})
        chosen = resolve_section(config, "attention", device=resolved.device, dtype=resolved.dtype,
                                 chosen=resolved.backends, source=resolved.source)
        resolved.backends["attention"] = chosen
    if (mla is not None) != ("mla" in chosen.cls.capabilities.features):
        kind = ("uses multi-head latent attention (MLA); choose an attention backend with the 'mla' "
                "feature, e.g. `attention: mla`" if mla is not None else
                "uses ordinary attention, which it cannot run; choose e.g. `attention: auto`")
        raise ConfigError(f"attention: backend {chosen.name!r} (plugin {chosen.info.plugin}) does not "
                          f"fit model_type {model_config.model_type!r}: the model {kind}")
    if mla is None:
        shape = {"num_kv_heads": model_config.num_kv_heads, "head_dim": model_config.head_dim}
        return shape, model_config.head_dim ** -0.5
    return {"num_kv_heads": 1, "head_dim": mla.latent_dim, "latent": True}, mla.softmax_scale


def _quant_method(resolved: ResolvedConfig, source) -> QuantMethod:
    """The quant method: the config's `quant:` section wins; else the checkpoint's
    `quantization_config` (`quant_method` names a registered method, options read by its
    ``from_checkpoint_config``); else plain weights. When both name the same method, the
    checkpoint's options are the base and the section's keys override them."""
    chosen = resolved.backends.get("quant")
    ckpt = source.hf_config.get("quantization_config") or None
    if chosen is None and ckpt is None:
        return Unquantized()
    if ckpt is not None and (chosen is None or chosen.name == str(ckpt.get("quant_method")).lower()):
        chosen = _checkpoint_quant(resolved, source, ckpt, chosen)
        resolved.backends["quant"] = chosen  # reported with the other backends
    return chosen.cls(chosen.options)


def _checkpoint_quant(resolved: ResolvedConfig, source, ckpt: dict,
                      explicit: ResolvedBackend | None) -> ResolvedBackend:
    where = f"{source.path}: config.json quantization_config"
    name = str(ckpt.get("quant_method")).lower()
    try:
        info = explicit.info if explicit else get_registry().get("quant", str(name))
    except PluginError as exc:
        raise ModelLoadError(f"{where}: quant_method {name!r} is not available ({exc})") from None
    if not info.cls.capabilities.fits(resolved.device, resolved.dtype):
        raise ConfigError(f"{where}: quant method {info.name!r} does not run on device "
                          f"{resolved.device!r} with dtype {resolved.dtype!r} "
                          f"({info.cls.capabilities.describe()})")
    overrides = {k: v for k, v in (resolved.config.quant or {}).items() if k != "method"}
    try:
        base = info.cls.from_checkpoint_config(dict(ckpt)).model_dump(exclude_unset=True)
        options = info.cls.Options(**{**base, **overrides})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(options)'}: {e['msg']} "
                             f"(got {e.get('input')!r})" for e in exc.errors())
        raise ModelLoadError(f"{where}: not usable by quant method {info.name!r} "
                             f"(plugin {info.plugin}): {problems}") from None
    return ResolvedBackend(info, options)


def _moe_backend(resolved: ResolvedConfig, model_config: ModelConfig) -> MoEBackend | None:
    """The moe backend of an MoE model. The section is resolved here, once the model is known:
    without a `moe` section an MoE model gets `auto`, and a dense model ignores one."""
    chosen = resolved.backends.get("moe")
    if model_config.moe is None:
        if chosen is not None:
            logger.warning("%s: moe: ignored, a %s model has no mixture-of-experts layers",
                           resolved.source, model_config.model_type)
            del resolved.backends["moe"]  # not reported as in use
        return None
    if chosen is None:
        chosen = resolve_section(resolved.config, "moe", device=resolved.device, dtype=resolved.dtype,
                                 source=resolved.source)
        resolved.backends["moe"] = chosen  # reported with the other backends (`lmplug bench`)
    return chosen.cls(chosen.options)


def _load_with_progress(model: torch.nn.Module, source, parallel: ParallelState | None = None) -> None:
    from tqdm import tqdm

    # tqdm waits `delay` seconds before drawing, so fast loads stay quiet.
    with tqdm(total=len(source.tensor_names), desc="loading weights", unit="tensor", delay=2.0,
              leave=False, disable=parallel is not None and parallel.rank != 0) as bar:  # one bar: rank 0's
        load_weights(model, source, progress=bar, parallel=parallel)


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
