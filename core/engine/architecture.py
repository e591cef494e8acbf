"""Which architecture (``model`` family) serves a checkpoint: resolved once, logged, explained.

``model_impl`` (``EngineConfig``): ``auto`` takes the highest-priority native architecture that
serves the checkpoint's ``config.json`` (``Architecture.serves``), else a fallback that can build
it (``transformers``); ``native`` never takes a fallback; ``transformers`` (or any other name)
takes that architecture, which must serve the checkpoint. Two architectures serving the same
checkpoint at the same priority: the one from the distribution sorted first wins, and the log says
which one was passed over. A GGUF file is served by an architecture declaring its
``general.architecture`` (``gguf_arch``), chosen before its metadata is translated (the chosen one
translates it). ``open_checkpoint`` opens a checkpoint with that order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lmplug.errors import ModelLoadError, PluginError
from lmplug.interfaces.architecture import Architecture
from lmplug.interfaces.checkpoint import ModelSource
from lmplug.interfaces.common import BackendInfo
from lmplug.interfaces.model_config import ModelConfig
from lmplug.loading import open_source
from lmplug.plugins import Registry, get_registry

logger = logging.getLogger(__name__)


def _describe(hf_config: Mapping[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    names = ", ".join(map(str, archs)) if isinstance(archs, list) else str(archs)
    return f"model_type {hf_config.get('model_type')!r}" + (f" (architectures: {names})" if names else "")


def open_checkpoint(path: Any, model_impl: str, registry: Registry | None = None,
                    ) -> tuple[ModelSource, tuple[BackendInfo, str]]:
    """The checkpoint and its architecture (and why): a GGUF's chosen from its
    ``general.architecture`` before that architecture translates its metadata."""
    chosen: list[tuple[BackendInfo, str]] = []

    def choose_gguf(arch: str, where: str) -> type[Architecture]:
        chosen.append(choose_architecture({}, model_impl, where, registry, gguf_arch=arch))
        return chosen[0][0].cls

    source = open_source(path, choose_gguf)
    if not chosen:
        chosen.append(choose_architecture(source.hf_config, model_impl, str(source.path), registry))
    return source, chosen[0]


def choose_architecture(hf_config: Mapping[str, Any], model_impl: str, where: str,
                        registry: Registry | None = None, gguf_arch: str | None = None,
                        ) -> tuple[BackendInfo, str]:
    """The architecture for this checkpoint and why. Raises ``ModelLoadError`` naming the
    checkpoint's architecture, the native ones installed and what the fallbacks said.
    ``gguf_arch``: a GGUF file's ``general.architecture`` (``hf_config`` is not read)."""
    table = (registry or get_registry()).backends("model")
    if gguf_arch is not None:
        return _choose_gguf(gguf_arch, model_impl, where, table)
    if model_impl not in ("auto", "native"):
        if model_impl not in table:
            raise ModelLoadError(f"model_impl: {model_impl!r} is not an installed architecture; "
                                 f"installed: auto, native, {', '.join(sorted(table)) or 'none'}")
        info = table[model_impl]
        reason = info.cls.serves(hf_config)
        if reason is None:
            why = info.cls.cannot_serve(hf_config) if info.cls.fallback else "it does not declare it"
            raise ModelLoadError(f"{where}: model_impl: {model_impl!r} cannot serve {_describe(hf_config)}: {why}")
        return info, f"model_impl {model_impl!r}: {reason}"
    # natives first: a fallback is asked (and may import its library) only when none serves
    serving: list[tuple[BackendInfo, str]] = [
        (info, why) for info in table.values() if not info.cls.fallback
        for why in [info.cls.serves(hf_config)] if why is not None]
    if not serving and model_impl == "auto":
        serving = [(info, why) for info in table.values() if info.cls.fallback
                   for why in [info.cls.serves(hf_config)] if why is not None]
    if not serving:
        raise ModelLoadError(_no_architecture(hf_config, table, model_impl, where))
    return _rank(serving, model_impl)


def _choose_gguf(arch: str, model_impl: str, where: str, table: Mapping[str, BackendInfo],
                 ) -> tuple[BackendInfo, str]:
    why = f"GGUF architecture {arch!r}"
    serving = [(info, why) for info in table.values() if arch in info.cls.gguf_architectures]
    if model_impl not in ("auto", "native"):
        serving = [(info, w) for info, w in serving if info.name == model_impl]
    if not serving:
        readers = sorted(f"{n} ({', '.join(i.cls.gguf_architectures)})" for n, i in table.items()
                         if i.cls.gguf_architectures)
        what = (f"model_impl: {model_impl!r} does not read GGUF architecture {arch!r}"
                if model_impl not in ("auto", "native") else f"GGUF architecture {arch!r} is not supported")
        raise ModelLoadError(f"{where}: {what}; the installed architectures that read GGUF files: "
                             f"{', '.join(readers) or 'none'}")
    return _rank(serving, model_impl)


def _rank(serving: list[tuple[BackendInfo, str]], model_impl: str) -> tuple[BackendInfo, str]:
    # natives before fallbacks, then priority, then distribution and name (stable across runs)
    serving.sort(key=lambda c: (c[0].cls.fallback, -c[0].cls.capabilities.priority,
                                c[0].distribution, c[0].name))
    (info, why), rest = serving[0], serving[1:]
    passed = [f"{o.name!r} ({o.distribution}, priority {o.cls.capabilities.priority})" for o, _ in rest]
    reason = f"{model_impl}: {why}, priority {info.cls.capabilities.priority}"
    if info.cls.fallback:
        reason += "; no native architecture serves it, so the fallback runs it"
    if passed:
        reason += f"; also serving: {', '.join(passed)}"
    return info, reason


def _no_architecture(hf_config: Mapping[str, Any], table: Mapping[str, BackendInfo], model_impl: str,
                     where: str) -> str:
    natives = sorted(n for n, i in table.items() if not i.cls.fallback)
    served = sorted({t for n in natives for t in table[n].cls.model_types})
    msg = (f"{where}: no architecture serves {_describe(hf_config)}; native architectures installed: "
           f"{', '.join(natives) or 'none'} (model types: {', '.join(served) or 'none'})")
    fallbacks = [i for i in table.values() if i.cls.fallback]
    if model_impl == "native":
        return msg + "; model_impl is 'native', so no fallback was tried (model_impl: auto allows one)"
    if not fallbacks:
        return msg + "; no fallback architecture is installed (e.g. lmplug's `transformers`)"
    notes = "; ".join(f"fallback {i.name!r} cannot take it: {i.cls.cannot_serve(hf_config)}" for i in fallbacks)
    return f"{msg}; {notes}"


def model_config_of(hf_config: Mapping[str, Any], where: str = "config.json", model_impl: str = "auto",
                    registry: Registry | None = None) -> ModelConfig:
    """``config.json`` as the architecture that serves it reads it (tools and tests that need a
    ``ModelConfig`` without an engine)."""
    info, _ = choose_architecture(hf_config, model_impl, where, registry)
    return architecture(info).parse_config(hf_config, where)


def architecture(info: BackendInfo, options: Any = None) -> Architecture:
    """The architecture object (its options validated: an architecture may have some)."""
    try:
        return info.cls(options if options is not None else info.cls.Options())
    except Exception as exc:  # a plugin's constructor: named, not a traceback
        raise PluginError(f"model: architecture {info.name!r} (plugin {info.plugin}) failed to build: "
                          f"{type(exc).__name__}: {exc}") from exc
