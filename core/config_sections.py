"""One plugin section of ``EngineConfig`` into a backend and its validated options.

``lmplug.config.resolve`` walks the sections in the family table's order and calls
``resolve_one`` for each (a family nested inside another section, such as
``speculative.acceptance``, through ``resolve_nested`` once its parent is chosen); then
``check_layouts`` and ``check_kv_dtype`` check the chosen attention and KV cache against each
other. A section names its backend, or says ``auto``: the highest ``Capabilities.priority``
among the installed backends that fit the device and dtype (for attention also the model's MLA
kind and the chosen cache's KV layout and stored dtype), with the candidates kept as the
reason. Errors name the file, the section, the backend's plugin and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lmplug.api import BackendInfo, BackendOptions
from lmplug.errors import ConfigError
from lmplug.families import Family, by_section, nested
from lmplug.plugins import Registry


@dataclass(frozen=True)
class ModelFacts:
    """What choosing backends needs to know of the model, read from its config before any
    weight: MLA models take an attention backend with the "mla" feature (and others one
    without), MoE models a moe backend (``auto`` without a section), dense models none."""

    model_type: str
    mla: bool = False
    moe: bool = False
    states: bool = False  # linear-attention / state-space layers: a mixer backend (``auto``)
    # the attention features its layers need (``interfaces.attention.needed_features``): ``auto``
    # picks among the backends that have them on the device
    attention_features: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ResolvedBackend:
    """A section's chosen backend and its options, validated by the backend's ``Options``."""

    info: BackendInfo
    options: BackendOptions

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def cls(self) -> type:
        return self.info.cls


def resolve_one(section: str, value: Mapping[str, Any] | None, *, device: str, dtype: str, registry: Registry,
                chosen: Mapping[str, ResolvedBackend], source: str,
                model: ModelFacts | None) -> tuple[ResolvedBackend, str]:
    """Section ``section`` (its config value; None: absent, ``auto`` where the family has it):
    the backend, its validated options, and why that backend. Raises ``ConfigError``."""
    family = by_section(section)
    raw = dict(value or {family.name_key: "auto"})
    name = raw.pop(family.name_key, "auto" if family.auto else None)
    for inner in nested():  # chosen inside this section, resolved by ``resolve_nested``
        if inner.within == section:
            raw.pop(inner.name, None)
    if name is None:
        raise ConfigError(f"{source}: {section}: missing `{family.name_key}` (which {family.name} to use)")
    if name == "auto":
        info, reason = _choose_auto(registry, section, family.name, device, dtype, chosen, source, model)
    else:
        info, reason = _choose_named(registry, section, family.name, name, device, dtype, source), \
            "named in the config"
    try:
        options = info.cls.Options(**raw)
    except ValidationError as exc:
        raise ConfigError(_explain_section(exc, source, section, info)) from None
    return ResolvedBackend(info, options), reason


def resolve_nested(raw: Any, family: Family, key: str, *, device: str, dtype: str, registry: Registry,
                   source: str) -> ResolvedBackend:
    """A family chosen inside another section (``speculative: {acceptance: typical}`` or
    ``{acceptance: {rule: typical, posterior_threshold: 0.1}}``): always named, never ``auto``."""
    if isinstance(raw, str):
        raw = {family.name_key: raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: {key}: expected a name or a mapping {{{family.name_key}: NAME, "
                          f"...options}}, got {type(raw).__name__}")
    raw = dict(raw)
    name = raw.pop(family.name_key, None)
    if not isinstance(name, str):
        raise ConfigError(f"{source}: {key}: missing `{family.name_key}` (which {family.name} to use; "
                          f"installed: {', '.join(sorted(registry.backends(family.name))) or 'none'})")
    info = _choose_named(registry, key, family.name, name, device, dtype, source)
    try:
        return ResolvedBackend(info, info.cls.Options(**raw))
    except ValidationError as exc:
        raise ConfigError(_explain_section(exc, source, key, info)) from None


def _choose_named(registry: Registry, section: str, family: str, name: str, device: str, dtype: str,
                  source: str) -> BackendInfo:
    try:
        info = registry.get(family, name)
    except Exception as exc:  # noqa: BLE001  (whatever the registry raises, named with the section)
        raise ConfigError(f"{source}: {section}: {exc}") from None
    caps = info.cls.capabilities
    if not caps.fits(device, dtype):
        raise ConfigError(f"{source}: {section}: {family} backend {name!r} does not run on "
                          f"device {device!r} with dtype {dtype!r} ({caps.describe()})")
    return info


def _choose_auto(registry: Registry, section: str, family: str, device: str, dtype: str,
                 chosen: Mapping[str, ResolvedBackend], source: str,
                 model: ModelFacts | None) -> tuple[BackendInfo, str]:
    """The highest-priority backend that fits, and why (the candidates, the winner's priority)."""
    candidates = [i for i in registry.backends(family).values()
                  if i.cls.capabilities.fits(device, dtype, auto=True)]
    fits = [f"device {device}", f"dtype {dtype}"]
    if section == "attention" and model is not None:  # MLA models need the "mla" feature, others not
        candidates = [i for i in candidates if ("mla" in i.cls.capabilities.features) == model.mla]
        fits.append(f"{'MLA' if model.mla else 'non-MLA'} model {model.model_type}")
        if model.attention_features:
            candidates = [i for i in candidates if model.attention_features
                          <= default_features(i, device)] or candidates  # none fits: the plan says why
            fits.append(f"features {', '.join(sorted(model.attention_features))}")
    if section == "attention" and "kvcache" in chosen:
        candidates = _kv_readers(candidates, chosen["kvcache"], device, source, fits,
                                 check_dtype=model is None or not model.mla)
    if not candidates:
        available = ", ".join(sorted(registry.backends(family))) or "none installed"
        note = f"; {registry.allowlist_note}" if getattr(registry, "allowlist_note", "") else ""
        raise ConfigError(f"{source}: {section}: no {family} backend fits device {device!r} and "
                          f"dtype {dtype!r} (installed: {available}{note})")
    best = max(candidates, key=lambda i: (i.cls.capabilities.priority, i.name))
    listed = ", ".join(f"{i.name} ({i.distribution}, priority {i.cls.capabilities.priority})" for i in
                       sorted(candidates, key=lambda i: (-i.cls.capabilities.priority, i.name)))
    return best, f"auto: fit {', '.join(fits)}: {listed}; highest priority wins"


def default_features(info: BackendInfo, device: str) -> frozenset[str]:
    """The features a backend gives on ``device`` with its default options."""
    try:
        return info.cls.features_for(info.cls.Options(), device)
    except ValidationError:  # options without defaults: what it declares
        return info.cls.capabilities.features


def _kv_readers(candidates: list[BackendInfo], kvcache: ResolvedBackend, device: str, source: str,
                fits: list[str], check_dtype: bool) -> list[BackendInfo]:
    """The attention candidates that read the chosen cache's layout (and stored dtype)."""
    layout = _layout_of(kvcache.info)
    candidates = [i for i in candidates if layout in i.cls.capabilities.kv_layouts]
    kv_dtype = kv_dtype_of(kvcache)
    fits.append(f"KV layout {layout or kvcache.name}")
    if not check_dtype:  # an MLA model: check_kv_dtype names the chosen backend
        return candidates
    readers = [i for i in candidates if kv_dtype in i.cls.capabilities.kv_dtypes]
    if candidates and not readers:
        raise ConfigError(f"{source}: kvcache.dtype={kv_dtype!r}: no attention backend that fits "
                          f"device {device!r} and the {layout or 'chosen'} KV layout reads it "
                          f"(candidates: {', '.join(sorted(i.name for i in candidates))})")
    fits.append(f"KV dtype {kv_dtype}")
    return readers


def kv_dtype_of(kvcache: ResolvedBackend) -> str:
    """What the chosen kvcache stores (``KVCacheBackend.kv_dtype_of``; "auto": the model dtype)."""
    return str(kvcache.cls.kv_dtype_of(kvcache.options))


def check_kv_dtype(chosen: Mapping[str, ResolvedBackend], source: str) -> None:
    """The attention backend must claim (``Capabilities.kv_dtypes``) the dtype the KV cache stores."""
    if "attention" not in chosen or "kvcache" not in chosen:
        return
    att, kv_dtype = chosen["attention"].info, kv_dtype_of(chosen["kvcache"])
    if kv_dtype not in att.cls.capabilities.kv_dtypes:
        raise ConfigError(
            f"{source}: kvcache.dtype={kv_dtype!r} is not read by attention backend {att.name!r} "
            f"(plugin {att.plugin}; it reads kv_dtypes {sorted(att.cls.capabilities.kv_dtypes)}); "
            f"use kvcache.dtype: auto or an attention backend that reads {kv_dtype!r} (`lmplug plugins`)")


def _layout_of(info: BackendInfo) -> str:
    layouts = info.cls.capabilities.kv_layouts
    return next(iter(layouts)) if len(layouts) == 1 else ""


def check_layouts(chosen: Mapping[str, ResolvedBackend], source: str) -> None:
    """The chosen attention backend reads a KV layout the chosen kvcache backend provides."""
    if "attention" not in chosen or "kvcache" not in chosen:
        return
    att, kv = chosen["attention"].info, chosen["kvcache"].info
    provided = kv.cls.capabilities.kv_layouts
    if not provided & att.cls.capabilities.kv_layouts:
        raise ConfigError(
            f"{source}: attention backend {att.name!r} (plugin {att.plugin}) reads KV layouts "
            f"{sorted(att.cls.capabilities.kv_layouts)}, but kvcache backend {kv.name!r} "
            f"(plugin {kv.plugin}) provides {sorted(provided)}; choose a matching pair")


def _explain_section(exc: ValidationError, source: str, section: str, info: BackendInfo) -> str:
    fields = info.cls.Options.model_fields
    allowed = ", ".join(fields) or "none"
    lines = [(f"{source}: {section}: invalid options for {info.family} backend {info.name!r} "
              f"(plugin {info.plugin})")]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  {section}.{key}: unknown option (allowed: {allowed})")
        else:
            lines.append(f"  {section}.{key}: {err['msg']}{got(err)}")
    return "\n".join(lines)


def got(err: Mapping[str, Any]) -> str:
    """`` (got VALUE)``, unless the message already says what it got."""
    value = err.get("input")
    return "" if f"got {value}" in err["msg"] or f"got {value!r}" in err["msg"] else f" (got {value!r})"
