"""What the core builds for a drafter (``DraftTarget``'s callables): a second model with a KV
cache of its own, a model runner over a drafter's model and cache, and fresh caches of the
target's KV class."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from lmplug.engine.runner import ModelRunner
from lmplug.interfaces import AttentionBackend, DraftTarget, KVCacheBackend
from lmplug.interfaces.drafter import DraftModel
from lmplug.interfaces.model_config import ModelConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def draft_target(model: torch.nn.Module, model_config: ModelConfig, kv: KVCacheBackend, tokenizer,
                 device: torch.device, dtype: torch.dtype, max_model_len: int, max_num_seqs: int,
                 attention: AttentionBackend, *, build: Callable) -> DraftTarget:
    """The ``DraftTarget`` of a target model, with the core's callables bound to its settings;
    ``build`` is the engine's ``build_engine_parts`` (handed in: the build imports this module)."""
    return DraftTarget(
        model, model_config, kv, tokenizer, device, dtype, max_model_len, max_num_seqs,
        attention=attention,
        open_model=functools.partial(open_draft_model, build=build, device=device, dtype=dtype,
                                     max_model_len=max_model_len, max_num_seqs=max_num_seqs),
        new_runner=functools.partial(new_runner, device=device,
                                     short_query_tokens=attention.short_query_tokens),
        new_kv_cache=functools.partial(draft_kv_cache, kv))


def open_draft_model(name_or_path: str, *, build: Callable, device: torch.device, dtype: torch.dtype,
                     max_model_len: int, max_num_seqs: int) -> DraftModel:
    """Load a draft model as an engine loads its target: on ``device`` in ``dtype``, its KV cache
    sized for ``max_model_len`` and ``max_num_seqs`` (backends: the default config's)."""
    from lmplug.config import EngineConfig, resolve

    dtype_name = _DTYPE_NAMES[dtype]
    config = EngineConfig.from_dict({
        "model": name_or_path, "device": device.type, "dtype": dtype_name,
        "max_model_len": max_model_len,
        "scheduler": {"backend": "auto", "max_num_seqs": max_num_seqs},
    }, source="speculative.model")
    resolved = resolve(config, device=device.type, dtype=dtype_name, source="speculative.model")
    parts = build(resolved)
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
    options = target_kv.options
    if "prefix_caching" in type(options).model_fields:
        options = options.model_copy(update={"prefix_caching": False})
    return type(target_kv)(options, dataclasses.replace(target_kv.spec, num_layers=num_layers, **spec))
