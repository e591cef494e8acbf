"""The engine plan: the one resolution made once the model's config is known, and what it fixes.

``make_plan`` re-runs ``lmplug.config.resolve`` with the model's facts (MLA models take the
attention backend with the "mla" feature; MoE models a moe backend, ``auto`` without a section;
dense models none), takes the quant method from the checkpoint's ``quantization_config`` where
the config names none (or the same one), checks the model against the choice and the
tensor-parallel layout, and returns an immutable ``EnginePlan``. The build constructs from the
plan; the one limit known only once the KV pool is allocated (its size can come from free memory)
is decided here too, by ``fit_pool``, which returns the plan with ``max_model_len`` lowered to what
the pool holds; the build then makes the KV spec and the scheduler's limits from that plan. At start-up the plan logs one INFO line per family: the backend
and why (named in the config, from the checkpoint, or ``auto``'s candidates and priorities).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from lmplug.config import (
    CpuConfig,
    ModelFacts,
    ResolvedBackend,
    ResolvedConfig,
    kv_dtype_of,
    resolve,
)
from lmplug.config_sections import default_features
from lmplug.engine.architecture import architecture as make_architecture
from lmplug.engine.architecture import choose_architecture
from lmplug.errors import ConfigError, ModelLoadError, PluginError
from lmplug.interfaces import architecture as arch_features
from lmplug.interfaces.attention import LayerAttention, needed_features
from lmplug.interfaces.common import BackendInfo
from lmplug.interfaces.model_config import ModelConfig
from lmplug.kit.devices import capability
from lmplug.parallel import ParallelState
from lmplug.parallel import setup as parallel_setup
from lmplug.plugins import get_registry

logger = logging.getLogger(__name__)

FROM_CHECKPOINT = "from the checkpoint's quantization_config"


@dataclass(frozen=True)
class CpuPolicy:
    """The CPU fast paths this engine takes (``cpu:``, or the environment's override)."""

    native_step: bool = True  # a decode step's layers in one C call, where every plugin has a C form
    fused_ops: bool = True  # the fused float32 CPU ops (process-wide)


# config key -> the environment variable that overrides it (documented in docs/configuration.md)
CPU_OVERRIDES = {"native_step": "LMPLUG_NATIVE_STEP", "fused_ops": "LMPLUG_FUSED_CPU"}


def cpu_policy(config: CpuConfig) -> CpuPolicy:
    """``config``'s keys, each overridden by its environment variable when that is set
    ("0", "false", "no", "off": off; anything else: on)."""
    values = config.model_dump()
    for key, env in CPU_OVERRIDES.items():
        value = os.environ.get(env, "").strip().lower()
        if value:
            values[key] = value not in ("0", "false", "no", "off")
    return CpuPolicy(**values)


@dataclass(frozen=True)
class EnginePlan:
    """Everything chosen for one engine (one rank), before anything is built."""

    resolved: ResolvedConfig  # every backend for this model, options validated
    model_config: ModelConfig
    where: str  # the model's path, for messages
    parallel: ParallelState  # this rank's shard layout (heads, slices, experts)
    kv_shape: Mapping[str, Any]  # ``KVCacheSpec`` fields per token: this rank's KV heads, head_dim, latent
    scale: float  # the attention softmax scale
    max_model_len: int
    architecture: BackendInfo | None = None  # the ``model`` family backend that serves the checkpoint
    architecture_reason: str = ""  # why (``engine.architecture.choose_architecture``), logged
    # how each cached layer attends, where the architecture declares it (``CacheLayout.layers``)
    attention_layers: tuple[LayerAttention, ...] = ()
    cpu: CpuPolicy = CpuPolicy()  # the CPU fast paths (config ``cpu:``, environment overrides)
    # an encoder (``ENCODER``): embeddings only, every prompt scheduled whole, no prefix reuse
    encoder: bool = False


def model_facts(model_config: ModelConfig, layers: tuple[LayerAttention, ...] = ()) -> ModelFacts:
    return ModelFacts(model_config.model_type, mla=model_config.mla is not None,
                      moe=model_config.moe is not None, states=model_config.has_states,
                      attention_features=frozenset(needed_features(layers)))


def make_plan(resolved: ResolvedConfig, hf_config: Mapping, model_config: ModelConfig, where: str,
              parallel: ParallelState, *, architecture: tuple[BackendInfo, str] | None = None,
              checkpoint_format: str = "hf") -> EnginePlan:
    """Resolve once for this model and check it fits. Raises ``ConfigError`` / ``ModelLoadError``.
    ``architecture``: the chosen architecture and why (default: chosen here from ``hf_config``)."""
    arch_info, arch_reason = architecture or choose_architecture(
        hf_config, resolved.config.model_impl, where, resolved.registry)
    layout = make_architecture(arch_info).cache_layout(model_config)
    final = resolve(resolved.config, device=resolved.device, dtype=resolved.dtype, registry=resolved.registry,
                    source=resolved.source, model=model_facts(model_config, layout.layers))
    attention = final.backends["attention"]
    _check_window_support(model_config, attention)
    _check_layer_features(model_config, layout.layers, final)
    _check_attention_fits(model_config, attention)
    _check_state_support(model_config, final)
    _check_connector_support(final, parallel)
    _check_swap_support(final, parallel)
    _check_architecture(arch_info, model_config, parallel, checkpoint_format)
    encoder = arch_features.ENCODER in arch_info.cls.capabilities.features
    kv_shape, scale = layout.kv_shape(), layout.scale
    if final.device == "cuda":  # what the attention kernels cannot build for this GPU, now
        attention.cls.check_target(attention.options, kv_dtype_of(final.backends["kvcache"]),
                                   max(d for _, d in kv_shape.get("layer_shapes", ((0, kv_shape["head_dim"]),))),
                                   final.dtype, capability("cuda"))
    parallel_setup.check_model(model_config, parallel.world_size, where, parallel.expert_parallel)
    backends, reasons = dict(final.backends), dict(final.reasons)
    quant = checkpoint_quant(final, hf_config, where)
    if quant is not None:
        backends["quant"], reasons["quant"] = quant, FROM_CHECKPOINT
    final = ResolvedConfig(final.config, final.device, final.dtype, backends, final.source, reasons,
                           final.model, final.registry)
    plan = EnginePlan(final, model_config, where, parallel,
                      MappingProxyType(parallel_setup.local_kv_shape(kv_shape, parallel)), scale,
                      resolved.config.max_model_len or model_config.max_position_embeddings,
                      arch_info, arch_reason, attention_layers=layout.layers,
                      cpu=cpu_policy(resolved.config.cpu), encoder=encoder)
    if encoder:
        _check_encoder_budget(plan)
    if parallel.rank == 0:
        logger.info("%s: model: architecture %r from %s (%s)", final.source, arch_info.name,
                    arch_info.distribution, arch_reason)
        log_choices(final)
    return plan


def fit_pool(plan: EnginePlan, pool_blocks: int | None, block_size: int, kv_name: str,
             sliding_window: int | None) -> EnginePlan:
    """The plan with ``max_model_len`` fitted to the KV pool: a block pool that cannot hold one
    ``max_model_len`` sequence lowers it to what it holds, with a warning (requests past it are
    refused with a clear error when they arrive, instead of failing mid-run). ``pool_blocks``
    None: a cache whose size the options fix. Sliding-window models are exempt: their cache
    frees what falls out of the window."""
    if pool_blocks is None or sliding_window is not None:
        return plan
    capacity = pool_blocks * block_size
    if capacity >= plan.max_model_len:
        return plan
    logger.warning("kvcache: the %s pool holds %d tokens (%d blocks of %d), fewer than "
                   "max_model_len=%d: max_model_len is clamped to %d; raise kvcache.num_blocks or "
                   "kvcache.memory_gb, or set max_model_len <= %d", kv_name, capacity, pool_blocks,
                   block_size, plan.max_model_len, capacity, capacity)
    return dataclasses.replace(plan, max_model_len=capacity)


def _check_architecture(info: BackendInfo, model_config: ModelConfig, parallel: ParallelState,
                        checkpoint_format: str) -> None:
    """What the configuration needs of the architecture, against the features it declares."""
    features = info.cls.capabilities.features
    needs = []
    if parallel.world_size > 1:
        needs.append((arch_features.TENSOR_PARALLEL, f"parallel.tensor_parallel_size={parallel.world_size}"))
    if checkpoint_format == "gguf":
        needs.append((arch_features.GGUF, "a GGUF checkpoint (model)"))
    if model_config.has_states:
        needs.append((arch_features.STATE_LAYERS, "the model's state layers (config.json layer types)"))
    if model_config.mla is not None:
        needs.append((arch_features.MLA, "the model's multi-head latent attention (config.json)"))
    for feature, what in needs:
        if feature not in features:
            raise ConfigError(f"model: architecture {info.name!r} (plugin {info.plugin}) cannot run "
                              f"{what}: it does not declare the {feature!r} feature; set model_impl to "
                              "an architecture that does (`lmplug plugins`), or change that option")


def log_choices(resolved: ResolvedConfig) -> None:
    """One INFO line per family: the backend, its distribution and priority, and why (for
    ``auto``: every candidate with its distribution and priority, so a plugin that outranks the
    first-party backends shows up here)."""
    for section, chosen in resolved.backends.items():
        reason = resolved.reasons.get(section, "named in the config")
        # `auto` choosing another distribution's backend is worth a line without -v
        level = logging.WARNING if reason.startswith("auto") and \
            chosen.info.distribution.split(" ")[0] != "lmplug" else logging.INFO
        logger.log(level, "%s: %s: %s %r from %s, priority %d (%s)", resolved.source, section,
                   chosen.info.family, chosen.name, chosen.info.distribution,
                   chosen.cls.capabilities.priority, reason)


def _check_window_support(model_config: ModelConfig, attention: ResolvedBackend) -> None:
    if model_config.sliding_window and "sliding_window" not in attention.cls.capabilities.features:
        raise ConfigError(f"attention: backend {attention.name!r} does not support sliding-window "
                          f"attention, which this {model_config.model_type} model uses "
                          f"(window {model_config.sliding_window}); choose one that lists the "
                          "'sliding_window' feature (`lmplug plugins`)")


def _check_layer_features(model_config: ModelConfig, layers: tuple[LayerAttention, ...],
                          resolved: ResolvedConfig) -> None:
    """The attention features the model's layers need (soft-caps, windows or scales per layer,
    sinks) against what the chosen backend gives with its options on this device: a backend
    without one is refused here, naming it, the model, the feature and backends that have it."""
    attention = resolved.backends["attention"]
    have = attention.cls.features_for(attention.options, resolved.device)
    for feature, what in needed_features(layers).items():
        if feature in have:
            continue
        registry = resolved.registry or get_registry()
        others = sorted(name for name, info in registry.backends("attention").items()
                        if feature in default_features(info, resolved.device)
                        and info.cls.capabilities.fits(resolved.device, resolved.dtype))
        hint = f"e.g. `attention: {others[0]}` (backends with it here: {', '.join(others)})" if others else \
            "no installed attention backend has it on this device"
        raise ConfigError(f"attention: backend {attention.name!r} (plugin {attention.info.plugin}) lacks the "
                          f"{feature!r} feature on {resolved.device} with these options, which this "
                          f"{model_config.model_type} model needs ({what}); {hint}")


def _check_encoder_budget(plan: EnginePlan) -> None:
    """An encoder's prompt runs in one step, so one step's token budget must hold the longest."""
    budget = plan.resolved.backends["scheduler"].options.max_num_batched_tokens
    if budget < plan.max_model_len:
        raise ConfigError(f"model: {plan.model_config.model_type!r} is an encoder: each prompt runs whole in one step, "
                          f"so scheduler.max_num_batched_tokens ({budget}) must be >= max_model_len "
                          f"({plan.max_model_len}); raise the first or lower the second")


def _check_state_support(model_config: ModelConfig, resolved: ResolvedConfig) -> None:
    """A model with state layers (linear attention, SSM) needs a kvcache backend that keeps
    per-sequence states ("state" feature) and cannot run what would have to roll a state back
    (speculative decoding). Tensor parallelism splits the state layers' heads (the models check
    their head counts at build)."""
    if not model_config.has_states:
        return
    kinds = sorted({k for k in model_config.layer_types if k != "attention"})
    what = f"this {model_config.model_type} model has state layers ({', '.join(kinds)})"
    kv = resolved.backends["kvcache"]
    if "state" not in kv.cls.capabilities.features:
        raise ConfigError(f"kvcache: backend {kv.name!r} (plugin {kv.info.plugin}) keeps no per-sequence "
                          f"state, which {what} need; choose one that lists the 'state' feature, e.g. "
                          "`kvcache: paged` or `kvcache: contiguous`")
    if "speculative" in resolved.backends:
        raise ConfigError(f"speculative: {what}, whose state cannot be rolled back past rejected draft "
                          "tokens; speculative decoding is not supported for it: remove the speculative section")


def _check_connector_support(resolved: ResolvedConfig, parallel: ParallelState) -> None:
    """A KV connector needs a kvcache backend that moves blocks ("kv_connector" feature) and one
    process (each tensor-parallel rank's pool holds only its heads)."""
    connector = resolved.backends.get("kvconnector")
    if connector is None:
        return
    kv = resolved.backends["kvcache"]
    if "kv_connector" not in kv.cls.capabilities.features:
        raise ConfigError(f"kvconnector: {connector.name!r} needs a kvcache backend that moves blocks to a tier "
                          f"(the 'kv_connector' feature); {kv.name!r} (plugin {kv.info.plugin}) does not: "
                          "use `kvcache: {backend: paged, prefix_caching: true}`")
    if parallel.world_size > 1:
        raise ConfigError(f"kvconnector: {connector.name!r} is not built for tensor parallelism "
                          f"(tensor_parallel_size={parallel.world_size}); remove the kvconnector section")


def _check_swap_support(resolved: ResolvedConfig, parallel: ParallelState) -> None:
    """Swap preemption copies blocks in rank 0's pool only: one process (as forks)."""
    scheduler = resolved.backends["scheduler"]
    if parallel.world_size > 1 and "swap" in scheduler.cls.features_for(scheduler.options):
        raise ConfigError(f"scheduler: {scheduler.name}: preemption: swap is not built for tensor parallelism "
                          f"(tensor_parallel_size={parallel.world_size}): each rank's pool holds its own heads; "
                          "use preemption: recompute")


def _check_attention_fits(model_config: ModelConfig, chosen: ResolvedBackend) -> None:
    """An MLA model (DeepSeek-V2/V3) needs a backend listing the "mla" feature, and such a
    backend runs MLA models only."""
    mla = model_config.mla
    if (mla is not None) != ("mla" in chosen.cls.capabilities.features):
        kind = ("uses multi-head latent attention (MLA); choose an attention backend with the 'mla' "
                "feature, e.g. `attention: mla`" if mla is not None else
                "uses ordinary attention, which it cannot run; choose e.g. `attention: auto`")
        raise ConfigError(f"attention: backend {chosen.name!r} (plugin {chosen.info.plugin}) does not "
                          f"fit model_type {model_config.model_type!r}: the model {kind}")


def checkpoint_quant(resolved: ResolvedConfig, hf_config: Mapping, where: str) -> ResolvedBackend | None:
    """The quant method when the checkpoint's `quantization_config` decides it: the config's
    `quant:` section wins unless it names the same method (then the checkpoint's options are the
    base and the section's keys override them). None: the config's choice (or plain weights)."""
    chosen = resolved.backends.get("quant")
    ckpt = hf_config.get("quantization_config") or None
    if ckpt is None or (chosen is not None and chosen.name != str(ckpt.get("quant_method")).lower()):
        return None
    where = f"{where}: config.json quantization_config"
    name = str(ckpt.get("quant_method")).lower()
    try:
        info = chosen.info if chosen else (resolved.registry or get_registry()).get("quant", str(name))
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
