"""What the core builds for a drafter (``DraftTarget``'s callables): a second model with a KV
cache of its own, a model runner over a drafter's model and cache, and fresh caches of the
target's KV class."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from lmplug.api import AttentionBackend, DraftTarget, KVCacheBackend
from lmplug.engine.runner import ModelRunner
from lmplug.errors import ConfigError
from lmplug.interfaces.checkpoint import ModelSource
from lmplug.interfaces.drafter import DraftModel, MTPDraft
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.quant import QuantMethod
from lmplug.kit import extras, kv_extras

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def draft_target(model: torch.nn.Module, model_config: ModelConfig, kv: KVCacheBackend, tokenizer,
                 device: torch.device, dtype: torch.dtype, max_model_len: int, max_num_seqs: int,
                 attention: AttentionBackend, *, checkpoint: str | None = None,
                 quant: QuantMethod | None = None) -> DraftTarget:
    """The ``DraftTarget`` of a target model, with the core's callables bound to its settings;
    ``checkpoint`` the target's checkpoint path and ``quant`` its quant method (MTP modules)."""
    runner = functools.partial(new_runner, device=device, short_query_tokens=extras.short_query_tokens(attention))
    return DraftTarget(
        model, model_config, kv, tokenizer, device, dtype, max_model_len, max_num_seqs,
        attention=attention,
        open_model=functools.partial(open_draft_model, device=device, dtype=dtype,
                                     max_model_len=max_model_len, max_num_seqs=max_num_seqs),
        new_runner=runner,
        new_kv_cache=functools.partial(draft_kv_cache, kv),
        open_mtp=functools.partial(open_mtp, model=model, checkpoint=checkpoint, kv=kv, attention=attention,
                                   quant=quant, device=device, dtype=dtype, new_runner=runner))


def open_draft_model(name_or_path: str, *, device: torch.device, dtype: torch.dtype,
                     max_model_len: int, max_num_seqs: int) -> DraftModel:
    """Load a draft model as an engine loads its target: on ``device`` in ``dtype``, its KV cache
    sized for ``max_model_len`` and ``max_num_seqs`` (backends: the default config's)."""
    from lmplug.config import EngineConfig, resolve
    from lmplug.engine.build import build_engine_parts  # here: the build imports this module

    dtype_name = _DTYPE_NAMES[dtype]
    config = EngineConfig.from_dict({
        "model": name_or_path, "device": device.type, "dtype": dtype_name,
        "max_model_len": max_model_len,
        "scheduler": {"backend": "auto", "max_num_seqs": max_num_seqs},
    }, source="speculative.model")
    resolved = resolve(config, device=device.type, dtype=dtype_name, source="speculative.model")
    parts = build_engine_parts(resolved)
    return DraftModel(parts.model, parts.model_config, parts.kv, parts.tokenizer, parts.runner)


def new_runner(model: torch.nn.Module, kv: KVCacheBackend, *, device: torch.device,
               short_query_tokens: int) -> ModelRunner:
    """The engine's model runner over a drafter's ``model`` (built on the target's layers or
    attention class), bound to its cache ``kv``, in the target attention's step order."""
    return ModelRunner(model, kv, device, short_query_tokens=short_query_tokens)


def draft_kv_cache(target_kv: KVCacheBackend, num_layers: int, **spec) -> KVCacheBackend:
    """A cache of the target's KV class for ``num_layers`` layers, without prefix caching
    (a draft's cached blocks may hold tokens the target later rejects); ``spec`` overrides
    other ``KVCacheSpec`` fields (e.g. a draft head's ``num_kv_heads``, ``head_dim``)."""
    options = kv_extras.draft_options(type(target_kv), target_kv.options)
    return type(target_kv)(options, dataclasses.replace(target_kv.spec, num_layers=num_layers, **spec))


def open_mtp(path: str | None, module: int, *, model: torch.nn.Module, checkpoint: str | None,
             kv: KVCacheBackend, attention: AttentionBackend, quant: QuantMethod | None, device: torch.device,
             dtype: torch.dtype, new_runner: Callable) -> MTPDraft:
    """Module ``module`` of the MTP weights in ``path`` (None: the target's checkpoint), built as
    the target architecture's layer after its last one (``lmplug.kit.mtp``), loaded and checked
    as the target's weights are, with a one-layer cache of the target's KV class."""
    from lmplug.interfaces.quant import Unquantized
    from lmplug.kit.mtp import MTPModule, mtp_layout
    from lmplug.loading import open_source
    from lmplug.loading.weights import load_weights

    where = path or checkpoint
    if where is None:
        raise ConfigError("speculative: mtp: the target's checkpoint is unknown; give speculative.path")
    if getattr(getattr(model, "tp", None), "is_parallel", False):
        raise ConfigError("speculative: mtp is not supported with tensor parallelism yet")
    if not hasattr(model, "new_layer"):
        raise ConfigError(f"speculative: mtp: the target {type(model).__name__} cannot build MTP layers")
    source = open_source(where)
    cfg = model.config
    if path is not None:
        _check_mtp_folder(source, cfg, path)
    found = mtp_layout(source.tensor_names, cfg.num_layers)
    if found is None:
        declared = source.hf_config.get("num_nextn_predict_layers")
        why = (f"; its config declares num_nextn_predict_layers={declared} but the weights are not there "
               "(transformers drops them when it saves a model)" if declared else "")
        raise ConfigError(f"speculative: mtp: {where} holds no multi-token-prediction weights (no "
                          f"model.layers.{cfg.num_layers}.eh_proj.weight, no mtp.fc.weight){why}; train a "
                          f"module with `lmplug train-drafter --method mtp MODEL OUT` and set "
                          f"speculative.path: OUT")
    layout, modules = found
    if module not in modules:
        raise ConfigError(f"speculative: mtp: module={module}, but {where} holds MTP module(s) {modules}")
    backend = type(attention)(attention.options, num_heads=attention.num_heads,
                              num_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
                              scale=attention.scale, sliding_window=attention.sliding_window)
    with torch.device(device):
        mtp = MTPModule(model, layout, module, source.tensor_names, dtype,
                        Unquantized() if path is not None or quant is None else quant, backend)
    wanted = {n for n in source.tensor_names if mtp.owns(n)}
    load_weights(mtp, _only(source, wanted))
    mtp.eval()
    cache = draft_kv_cache(kv, 1)
    return MTPDraft(mtp, cache, new_runner(mtp, cache), len(modules), str(where))


def _check_mtp_folder(source, cfg: ModelConfig, path: str) -> None:
    """A folder of MTP weights must be written for a model of the target's shape."""
    for key, ours in (("num_hidden_layers", cfg.num_layers), ("hidden_size", cfg.hidden_size),
                      ("vocab_size", cfg.vocab_size)):
        theirs = source.hf_config.get(key)
        if theirs != ours:
            raise ConfigError(f"speculative: mtp: {path}/config.json has {key}={theirs}, the target "
                              f"{ours}: the module was written for another model")


def _only(source: ModelSource, names: set[str]) -> ModelSource:
    """``source`` restricted to ``names``, reading only those tensors."""
    def iter_tensors():
        if source.iter_slices is not None:
            yield from ((n, s[:]) for n, s in source.iter_slices() if n in names)
        else:
            yield from ((n, t) for n, t in source.iter_tensors() if n in names)

    return dataclasses.replace(source, tensor_names=[n for n in source.tensor_names if n in names],
                               iter_tensors=iter_tensors, iter_slices=None, iter_packed=None)
