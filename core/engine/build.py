"""Build everything an engine runs from a resolved config: model, KV cache, backends."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmplug.api import Drafter, KVCacheBackend, KVCacheSpec, Scheduler, SchedulerLimits
from lmplug.config import ResolvedConfig
from lmplug.engine.adapters import Adapters
from lmplug.engine.architecture import architecture, open_checkpoint
from lmplug.engine.draft_parts import draft_target
from lmplug.engine.plan import EnginePlan, fit_pool, make_plan
from lmplug.engine.runner import ModelRunner
from lmplug.errors import ConfigError, ModelLoadError
from lmplug.interfaces.acceptance import AcceptanceRule
from lmplug.interfaces.constraint import ConstraintBackend, ConstraintTokenizer
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.quant import QuantMethod, Unquantized
from lmplug.kit import extras, fused_cpu, hugemem, kv_extras, native_build
from lmplug.loading.identity import model_identity
from lmplug.loading.memory import check_fits
from lmplug.loading.pooling_config import ModelPooling, read_pooling
from lmplug.loading.weights import load_weights
from lmplug.parallel import ParallelState
from lmplug.parallel import setup as parallel_setup
from lmplug.parallel import single as single_parallel
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
    acceptance: AcceptanceRule | None = None  # speculative.acceptance (None: exact speculative sampling)
    constraint: ConstraintBackend | None = None  # the grammar engine for structured output
    # weight bytes and KV bytes per token of every tensor-parallel rank (``parallel.setup``)
    memory: dict | None = None
    plan: EnginePlan | None = None  # what was chosen (``plan.resolved.backends``: every backend in use)
    # the checkpoint's embedding recipe (sentence-transformers modules, Matryoshka sizes)
    pooling: ModelPooling = field(default_factory=ModelPooling)
    adapters: Adapters | None = None  # LoRA adapters (the ``lora:`` section), None: none


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

    source, (info, _) = open_checkpoint(resolve_model(resolved.config.model), resolved.config.model_impl,
                                        resolved.registry)
    return parse_model_config(info, source), str(source.path)


def parse_model_config(info, source, arch=None) -> ModelConfig:
    """The chosen architecture's reading of ``config.json`` (a fallback's failure explained)."""
    arch = arch or architecture(info)
    try:
        return arch.parse_config(source.hf_config, config_file(source))
    except Exception as exc:
        if not info.cls.fallback:
            raise
        raise _fallback_failed(info, source, "read", exc) from None


def _fallback_failed(info, source, what: str, exc: Exception) -> Exception:
    """A fallback that fails on a checkpoint no native architecture serves: say that first (what
    the user most needs to know), then the fallback's own error. Chosen by name over a native
    one (``model_impl: transformers``): its own error, any exception named."""
    table = get_registry().backends("model").values()
    detail = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
    if any(not i.cls.fallback and i.cls.serves(source.hf_config) for i in table):
        return exc if isinstance(exc, ModelLoadError) else ModelLoadError(
            f"{config_file(source)}: the {info.name!r} architecture could not {what} it: {detail}")
    natives = sorted({t for i in table if not i.cls.fallback for t in i.cls.model_types})
    return ModelLoadError(
        f"{config_file(source)}: no native architecture serves model_type "
        f"{source.hf_config.get('model_type')!r} (native model types: {', '.join(natives)}), and the "
        f"{info.name!r} fallback could not {what} it: {detail}")


# a CPU step of at most this many tokens (batch-1 decode, a few sequences' decodes, a verify)
# runs torch's small ops on one thread when the products have threads of their own
SMALL_STEP_TOKENS = 16


def small_step_tokens(quant: QuantMethod, device: torch.device, parallel: ParallelState) -> int:
    """The runner's ``small_step_tokens``: ``SMALL_STEP_TOKENS`` where the quant method's
    products split across their own threads on this CPU (``lmplug.kit.extras.OwnThreads``; one
    process: tensor-parallel slices are dense), else 0."""
    if device.type != "cpu" or parallel.is_parallel or not extras.own_threads(quant, device):
        return 0
    return SMALL_STEP_TOKENS


def build_engine_parts(resolved: ResolvedConfig, parallel: ParallelState | None = None,
                       group=None) -> EngineParts:
    """``parallel``: this process's rank of a tensor-parallel group (None: one process); the
    model and KV cache are then built with this rank's heads, slices and KV heads."""
    from lmplug.loading.cache import resolve_model

    cfg = resolved.config
    parallel = parallel or single_parallel()
    started = time.perf_counter()
    # an unsupported architecture is the error to report, not the config keys it lacks
    source, chosen = open_checkpoint(resolve_model(cfg.model), cfg.model_impl, resolved.registry)
    arch = architecture(chosen[0])
    model_config = parse_model_config(chosen[0], source, arch)
    pooling = read_pooling(Path(source.path), source.hf_config)
    plan = make_plan(resolved, source.hf_config, model_config, str(source.path), parallel,
                     architecture=chosen, checkpoint_format=source.format)
    backends, kv_shape = plan.resolved.backends, plan.kv_shape
    if plan.encoder and source.tokenizer is not None:
        source.tokenizer.post_process = True  # [CLS] ... [SEP], as the encoder was trained
    dtype = DTYPES[resolved.dtype]
    device = torch.device(resolved.device)
    max_model_len = plan.max_model_len
    attention = backends["attention"].cls(
        backends["attention"].options, num_heads=model_config.num_heads // parallel.world_size,
        num_kv_heads=kv_shape["num_kv_heads"], head_dim=kv_shape["head_dim"],
        scale=plan.scale, sliding_window=model_config.sliding_window, layers=plan.attention_layers)
    drafter = None
    if "speculative" in backends:
        drafter = backends["speculative"].cls(backends["speculative"].options)
        _check_tree_support(drafter, backends["attention"], device, parallel)
    acceptance = _built(backends, "speculative.acceptance")
    check_fits(model_config, config_file(source), dtype, device, quantized="quant" in backends,
               world_size=parallel.world_size)
    quant = _built(backends, "quant", Unquantized())
    with torch.device(device):
        # model-decided families: an MoE backend for MoE layers, a mixer backend for state layers
        extra = {section: _built(backends, section) for section in ("moe", "mixer") if section in backends}
        try:
            model = arch.build(model_config, dtype=dtype, quant=quant, attention=attention,
                               max_model_len=max_model_len, parallel=parallel, **extra)
        except Exception as exc:
            if not chosen[0].cls.fallback:
                raise
            raise _fallback_failed(chosen[0], source, "build", exc) from None
    if parallel.stage.split and not getattr(model, "pipeline_stages", False):
        raise ConfigError(f"parallel.pipeline_parallel_size={parallel.stage.num_stages}: the {chosen[0].name!r} "
                          f"architecture ({model_config.model_type}) builds no pipeline stages; use "
                          "pipeline_parallel_size 1")
    _load_with_progress(model, source, parallel)
    model.eval()
    if device.type == "cpu":
        fused_cpu.set_enabled(plan.cpu.fused_ops)  # the plan's CPU policy (process-wide ops)
        if not plan.cpu.native_step and hasattr(model, "allow_native_step"):
            model.allow_native_step(False)
        build_cpu_kernels()
    adapters = _adapters(backends, model, parallel)

    sched_opts = backends["scheduler"].options
    # state layers (linear attention, SSM) keep a fixed-size state per sequence; the K/V cache
    # holds the softmax layers only
    states = model.state_specs() if model_config.has_states else ()
    spec = KVCacheSpec(num_layers=model_config.num_kv_layers, **kv_shape, dtype=dtype, device=device,
                       max_model_len=max_model_len, max_num_seqs=sched_opts.max_num_seqs,
                       sliding_window=model_config.sliding_window,
                       max_num_batched_tokens=sched_opts.max_num_batched_tokens, states=states,
                       layer_windows=_layer_windows(plan))
    spec = stage_spec(spec, parallel.stage)
    kv = parallel_setup.build_kv(backends["kvcache"].cls, backends["kvcache"].options, spec, parallel)
    plan, kv = _fit_pool(plan, kv, backends["kvcache"], spec, parallel)
    if "kvconnector" in backends:  # a tier for prefix-cached blocks (host memory, disk), on the fitted pool
        kv.attach_connector(_built(backends, "kvconnector"), model_identity(
            source.path, source.hf_config, resolved.dtype, backends["quant"].name if "quant" in backends else None))
    max_model_len = plan.max_model_len
    limits = SchedulerLimits(sched_opts.max_num_seqs, sched_opts.max_num_batched_tokens, max_model_len)
    scheduler = backends["scheduler"].cls(sched_opts, kv, limits)
    # group: rank 0's handle on the tensor-parallel workers (``lmplug.parallel.launch``), if any
    runner = ModelRunner(model, kv, device, parallel=group, short_query_tokens=extras.short_query_tokens(attention),
                         keep_hidden=drafter is not None and drafter.uses_hidden_states,
                         small_step_tokens=small_step_tokens(quant, device, parallel), stage=parallel.stage)
    runner.adapters = adapters
    if drafter is not None:
        drafter.setup(draft_target(model, model_config, kv, source.tokenizer, device, dtype,
                                   max_model_len, sched_opts.max_num_seqs, attention,
                                   checkpoint=str(source.path), quant=quant))
    if device.type == "cpu":
        hugemem.trim_heap()  # the load's freed heap back to the system, not resident beside the weights
    load_time = time.perf_counter() - started
    logger.info("loaded %s (%s, %d layers) in %.2f s; KV: %s (%s), %d bytes/token", source.path,
                model_config.model_type, model_config.num_layers, load_time, kv.name,
                kv.spec.kv_dtype if kv.spec.quantized else resolved.dtype, kv.bytes_per_token)
    memory = parallel_setup.memory_report(model, kv, parallel)
    eos_ids = _eos_ids(source)
    constraint = None
    if "constraint" in backends and source.tokenizer is not None and not plan.encoder:  # encoders never generate
        chosen = backends["constraint"]
        constraint = chosen.cls(chosen.options, ConstraintTokenizer(
            source.tokenizer.backend, model_config.vocab_size, eos_ids))
    return EngineParts(model_config, model, source.tokenizer, kv, scheduler, runner, max_model_len,
                       eos_ids, load_time, drafter, acceptance, constraint=constraint, memory=memory, plan=plan,
                       pooling=pooling, adapters=adapters)


def _adapters(backends, model: torch.nn.Module, parallel: ParallelState) -> Adapters | None:
    """The LoRA slots in the model's linear layers, when the ``lora:`` section is set (on every
    tensor-parallel rank: each holds its shard of the adapters)."""
    if "lora" not in backends:
        return None
    if parallel.stage.split:
        raise ConfigError(f"lora: LoRA adapters with pipeline parallelism (parallel.pipeline_parallel_size="
                          f"{parallel.stage.num_stages}) are not supported yet; use pipeline_parallel_size 1 "
                          "(tensor_parallel_size works with LoRA)")
    chosen = backends["lora"]
    return Adapters(chosen.cls(chosen.options), chosen.options, model)


def _layer_windows(plan: EnginePlan) -> tuple[int | None, ...]:
    """Each cached layer's window where they differ (``KVCacheSpec.layer_windows``), else (). A
    layout may declare more attention layers than it caches (DiffusionGemma's decoder layers read
    the encoder's cache through ids past it): only the cached ones count."""
    cached = plan.attention_layers[:plan.model_config.num_kv_layers]
    windows = tuple(layer.sliding_window for layer in cached)
    return windows if len(set(windows)) > 1 else ()


def stage_spec(spec: KVCacheSpec, stage) -> KVCacheSpec:
    """A pipeline stage's cache: its own layers' K/V (their windows and shapes) and states only."""
    if not stage.split:
        return spec
    end = stage.end if spec.num_layers else stage.start  # a model of state layers only caches no K/V
    local = {"num_layers": end - stage.start}
    if spec.layer_windows:
        local["layer_windows"] = spec.layer_windows[stage.start:end]
    if spec.layer_shapes:
        local["layer_shapes"] = spec.layer_shapes[stage.start:end]
    return dataclasses.replace(spec, **local)


def build_cpu_kernels() -> float:
    """Compile the declared native CPU kernels not yet cached for this machine, now rather than
    inside the first (timed) generation; one line on stderr when something was compiled."""
    spent = native_build.build_declared()
    if spent > 0:
        print(f"[lmplug] building CPU kernels for this machine, once: {spent:.1f} s", file=sys.stderr)
    return spent


def _fit_pool(plan: EnginePlan, kv: KVCacheBackend, chosen, spec: KVCacheSpec,
              parallel: ParallelState) -> tuple[EnginePlan, KVCacheBackend]:
    """The plan's limits once the pool's size is known (``plan.fit_pool``); when it lowers
    ``max_model_len``, the cache is rebuilt with the same blocks and the plan's limit, so that its
    spec, the scheduler's limits and the engine agree."""
    fitted = fit_pool(plan, kv_extras.pool_blocks(kv), kv.block_size, kv.name, spec.sliding_window)
    if fitted.max_model_len == spec.max_model_len:
        return fitted, kv
    options = kv_extras.with_pool_blocks(chosen.cls, chosen.options, kv_extras.pool_blocks(kv))
    del kv  # (its pool goes before the rebuilt one takes the same memory)
    spec = dataclasses.replace(spec, max_model_len=fitted.max_model_len)
    return fitted, parallel_setup.build_kv(chosen.cls, options, spec, parallel)


def config_file(source) -> str:
    """The file a model's config came from: an HF folder's config.json, or the GGUF itself."""
    path = Path(source.path)
    return str(path / "config.json" if source.format == "hf" else path)


def _built(backends, section: str, default=None):
    """The backend of ``section``, constructed from its options; ``default`` when none."""
    chosen = backends.get(section)
    return default if chosen is None else chosen.cls(chosen.options)


def _check_tree_support(drafter, chosen, device: torch.device, parallel: ParallelState) -> None:
    """A drafter that proposes trees needs tree attention (the "tree_attention" feature of the
    backend's ``features_for(options, device)``) and one process: the accepted path's K/V is moved
    in this process's cache."""
    if not drafter.drafts_trees:
        return
    if "tree_attention" not in chosen.cls.features_for(chosen.options, device.type):
        how = ("its options give no tree mask on this device (e.g. `attention: {backend: paged, "
               "kernels: torch}`, or sdpa)" if "tree_attention" in chosen.cls.capabilities.features
               else "choose one that lists the 'tree_attention' feature (sdpa, paged)")
        raise ConfigError(f"speculative: {drafter.name}: tree candidates (option `tree`) need tree attention, "
                          f"which attention backend {chosen.name!r} (plugin {chosen.info.plugin}) on "
                          f"{device.type} does not provide: {how}; or drop `speculative.tree` to draft a chain")
    if parallel.world_size > 1:
        raise ConfigError(f"speculative: {drafter.name}: tree candidates (option `tree`) are not supported "
                          "with tensor parallelism; drop `speculative.tree` to draft a chain")


def _load_with_progress(model: torch.nn.Module, source, parallel: ParallelState | None = None) -> None:
    from tqdm import tqdm

    # tqdm waits `delay` seconds before drawing, so fast loads stay quiet; one bar (rank 0's), and
    # none where stderr is not a terminal (disable=None: tqdm's own check; logs get no \r floods)
    quiet = True if parallel is not None and parallel.global_rank != 0 else None
    with tqdm(total=len(source.tensor_names), desc="loading weights", unit="tensor", delay=2.0,
              leave=False, disable=quiet) as bar:
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
