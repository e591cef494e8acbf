"""Which architecture (``model`` family) serves a checkpoint: resolved once, logged, explained.

``model_impl`` (``EngineConfig``): ``auto`` takes the highest-priority native architecture that
serves the checkpoint's ``config.json`` (``Architecture.serves``), else a fallback that can build
it (``transformers``); ``native`` never takes a fallback; ``transformers`` (or any other name)
takes that architecture, which must serve the checkpoint. Two architectures serving the same
checkpoint at the same priority: the one from the distribution sorted first wins, and the log says
which one was passed over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lmplug.errors import ModelLoadError, PluginError
from lmplug.interfaces.architecture import Architecture
from lmplug.interfaces.common import BackendInfo
from lmplug.plugins import Registry, get_registry

logger = logging.getLogger(__name__)


def _describe(hf_config: Mapping[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    names = ", ".join(map(str, archs)) if isinstance(archs, list) else str(archs)
    return f"model_type {hf_config.get('model_type')!r}" + (f" (architectures: {names})" if names else "")


def choose_architecture(hf_config: Mapping[str, Any], model_impl: str, where: str,
                        registry: Registry | None = None) -> tuple[BackendInfo, str]:
    """The architecture for this checkpoint and why. Raises ``ModelLoadError`` naming the
    checkpoint's architecture, the native ones installed and what the fallbacks said."""
    table = (registry or get_registry()).backends("model")
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
    serving = [(info, why) for info in table.values() if not info.cls.fallback
               for why in [info.cls.serves(hf_config)] if why is not None]
    if not serving and model_impl == "auto":
        serving = [(info, why) for info in table.values() if info.cls.fallback
                   for why in [info.cls.serves(hf_config)] if why is not None]
    if not serving:
        raise ModelLoadError(_no_architecture(hf_config, table, model_impl, where))
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


def architecture(info: BackendInfo, options: Any = None) -> Architecture:
    """The architecture object (its options validated: an architecture may have some)."""
    try:
        return info.cls(options if options is not None else info.cls.Options())
    except Exception as exc:  # a plugin's constructor: named, not a traceback
        raise PluginError(f"model: architecture {info.name!r} (plugin {info.plugin}) failed to build: "
                          f"{type(exc).__name__}: {exc}") from exc
