"""``EngineConfig``: the YAML file users write, validated entirely at load time.

Each plugin section names a backend (``backend:``, or ``method:`` for quant
and speculative) and its options; the options are validated by that
backend's pydantic ``Options`` model, so unknown keys and bad values fail
here, with the file, the key, the value and what is allowed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from lmplug.errors import ConfigError
from lmplug.interfaces import BackendInfo, BackendOptions
from lmplug.interfaces.families import Family, by_section, configured, nested
from lmplug.plugins import Registry, get_registry

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB; refuse anything larger before reading it

# config section -> (plugin family, key that names the backend), in resolution order; from the
# family table (``lmplug.interfaces.families``)
SECTIONS: dict[str, tuple[str, str]] = {f.section: (f.name, f.name_key) for f in configured()}
# absent = feature off / not an MoE model
OPTIONAL_SECTIONS = frozenset(f.section for f in configured() if f.optional)


class ParallelConfig(BaseModel):
    """``parallel:``: tensor parallelism (checked against the model's heads and sizes at load)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(
        default=1, ge=1, description="processes each layer is split across (rank 0 is the engine's own; "
        "it starts the others, or joins a `torchrun` launch); must divide the attention heads and the "
        "intermediate size")
    expert_parallel: bool = Field(
        default=False, description="MoE models: each rank holds whole routed experts (E/N of them, "
        "`[rank*E/N, (rank+1)*E/N)`; N must divide the expert count) and computes only their share of "
        "every token, instead of a 1/N slice of every expert's width; the router and a shared expert "
        "are split as without it. No effect on dense models")
    timeout_s: float = Field(default=300.0, gt=0, description="longest wait in one collective before the "
                             "group gives up (a dead worker is detected at once)")


class EngineConfig(BaseModel):
    """Everything one engine is built from."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="model name in the cache, HF folder, or .gguf file")
    tokenizer: str | None = Field(default=None, description="tokenizer folder/file if not the model's")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="weights and activations; auto: float32 on CPU, bfloat16 on CUDA")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when available")
    max_model_len: int | None = Field(default=None, ge=1, description="context limit; default: the model's")
    seed: int = Field(default=0, ge=0, le=2**64 - 1,
                      description="seeds requests that give no seed of their own (0 to 2**64-1)")
    attention: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    kvcache: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    scheduler: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    moe: dict[str, Any] | None = Field(default=None, description="MoE models only; see below")
    quant: dict[str, Any] | None = Field(default=None, description="absent: the checkpoint's own format")
    speculative: dict[str, Any] | None = Field(default=None, description="absent: no speculative decoding")
    structured_output: dict[str, Any] = Field(
        default_factory=lambda: {"backend": "auto"},
        description="the grammar engine for structured output and forced tool calls; see below")
    compression: dict[str, Any] | None = Field(
        default=None, description="absent: no prompt compression; present: the default for every request")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="tensor parallelism")

    @field_validator(*SECTIONS, mode="before")
    @classmethod
    def _name_only(cls, value: Any, info: ValidationInfo) -> Any:
        """``attention: sdpa`` is short for ``attention: {backend: sdpa}``."""
        if isinstance(value, str):
            return {SECTIONS[info.field_name][1]: value}
        return value

    # -- construction --------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> EngineConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, source)) from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        path = Path(path)
        text = _read_config_file(path)
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
            raise ConfigError(f"{path}: not valid YAML: {problem}{where}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of options at the top level, got {type(data).__name__}")
        return cls.from_dict(merge(data, overrides), source=str(path))

    @classmethod
    def default(cls, **overrides: Any) -> EngineConfig:
        return cls.from_yaml(DEFAULT_CONFIG, **overrides)


def _read_config_file(path: Path) -> str:
    """The file's text: a regular file of at most ``MAX_CONFIG_BYTES``, checked before reading
    (a device such as /dev/zero or a FIFO would never end)."""
    import os
    import stat

    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"config file {path}: not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path}: {info.st_size} bytes, larger than the "
                              f"{MAX_CONFIG_BYTES} bytes a config file may have")
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; plugin sections merge key by key (a new backend name drops old options)."""
    out = dict(base)
    for key, value in overrides.items():
        if value is None and key not in OPTIONAL_SECTIONS:
            continue
        if key in SECTIONS and isinstance(value, str):
            value = {SECTIONS[key][1]: value}
        old = out.get(key)
        if key == "parallel" and isinstance(value, dict) and isinstance(old, dict):
            value = {**old, **value}
        if key in SECTIONS and isinstance(value, dict) and isinstance(old, dict):
            name_key = SECTIONS[key][1]
            if name_key in value and value[name_key] != old.get(name_key):
                old = {}
            value = {**old, **value}
        out[key] = value
    return out


def _explain(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown option (allowed: {', '.join(EngineConfig.model_fields)})")
        else:
            lines.append(f"  {key}: {err['msg']}{_got(err)}")
    return "\n".join(lines)


def _got(err: Mapping[str, Any]) -> str:
    """`` (got VALUE)``, unless the message already says what it got."""
    value = err.get("input")
    return "" if f"got {value}" in err["msg"] or f"got {value!r}" in err["msg"] else f" (got {value!r})"


def _check_sections() -> None:
    """Every section of the family table is a field of ``EngineConfig`` (and the reverse)."""
    fields = {k for k, f in EngineConfig.model_fields.items() if f.annotation in (dict[str, Any],
                                                                             dict[str, Any] | None)}
    if fields != set(SECTIONS):
        raise RuntimeError(f"EngineConfig's plugin sections {sorted(fields)} differ from the family "
                           f"table's {sorted(SECTIONS)}")


_check_sections()


# -- choosing backends ------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What choosing backends needs to know of the model, read from its config before any
    weight: MLA models take an attention backend with the "mla" feature (and others one
    without), MoE models a moe backend (``auto`` without a section), dense models none."""

    model_type: str
    mla: bool = False
    moe: bool = False


@dataclass(frozen=True)
class ResolvedBackend:
    info: BackendInfo
    options: BackendOptions

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def cls(self) -> type:
        return self.info.cls


@dataclass(frozen=True)
class ResolvedConfig:
    """The config with every section's backend chosen and its options validated. Immutable:
    the engine build plans from it (``lmplug.engine.plan``) and returns a new one."""

    config: EngineConfig
    device: str
    dtype: str
    # section -> backend: optional sections only when set; with the model known (``model``)
    # also `moe` for a mixture-of-experts model (``auto``), never for a dense one
    backends: Mapping[str, ResolvedBackend]
    source: str = "config"  # where the config came from, for error messages
    # section -> why this backend ("named in the config", or auto's candidates and priority)
    reasons: Mapping[str, str] = field(default_factory=dict)
    model: ModelFacts | None = None  # what the choice knew of the model (None: not yet peeked)
    registry: Registry | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", MappingProxyType(dict(self.backends)))
        object.__setattr__(self, "reasons", MappingProxyType(dict(self.reasons)))


def resolve(config: EngineConfig, *, device: str, dtype: str, registry: Registry | None = None,
            source: str = "config", model: ModelFacts | None = None) -> ResolvedConfig:
    """Choose every backend and validate its options. Raises ``ConfigError``.

    Without ``model`` (the config alone, as at load): every set section. With it (the engine
    build, once the model's config is peeked): MLA-aware attention, `moe` for MoE models only."""
    registry = registry or get_registry()
    chosen: dict[str, ResolvedBackend] = {}
    reasons: dict[str, str] = {}
    for section in SECTIONS:
        needed = section == "moe" and model is not None and model.moe
        if getattr(config, section) is not None or needed:
            chosen[section], reasons[section] = _resolve_section(
                config, section, device=device, dtype=dtype, registry=registry, chosen=chosen,
                source=source, model=model)
    for family in nested():  # e.g. speculative.acceptance, once its parent section is set
        key = f"{family.within}.{family.name}"
        raw = (getattr(config, family.within) or {}).get(family.name)
        if family.within in chosen and raw is not None:
            chosen[key] = _resolve_nested(raw, family, key, device=device, dtype=dtype, registry=registry,
                                          source=source)
            reasons[key] = "named in the config"
    if model is not None and not model.moe and "moe" in chosen:
        logger.warning("%s: moe: ignored, a %s model has no mixture-of-experts layers", source, model.model_type)
        del chosen["moe"], reasons["moe"]
    _check_layouts(chosen, source)
    check_kv_dtype(chosen, source)
    return ResolvedConfig(config, device, dtype, chosen, source, reasons, model, registry)


def resolve_section(config: EngineConfig, section: str, *, device: str, dtype: str,
                    registry: Registry | None = None, chosen: Mapping[str, ResolvedBackend] | None = None,
                    source: str = "config", model: ModelFacts | None = None) -> ResolvedBackend:
    """Choose one section's backend and validate its options; an absent section is ``auto``
    where the family has it. Raises ``ConfigError``."""
    return _resolve_section(config, section, device=device, dtype=dtype, registry=registry or get_registry(),
                            chosen=chosen or {}, source=source, model=model)[0]


def _resolve_section(config: EngineConfig, section: str, *, device: str, dtype: str, registry: Registry,
                     chosen: Mapping[str, ResolvedBackend], source: str,
                     model: ModelFacts | None) -> tuple[ResolvedBackend, str]:
    family = by_section(section)
    raw = dict(getattr(config, section) or {family.name_key: "auto"})
    name = raw.pop(family.name_key, "auto" if family.auto else None)
    for inner in nested():  # chosen inside this section, resolved by ``_resolve_nested``
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


def _resolve_nested(raw: Any, family: Family, key: str, *, device: str, dtype: str, registry: Registry,
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
    except Exception as exc:
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
    candidates = [i for i in registry.backends(family).values() if i.cls.capabilities.fits(device, dtype)]
    fits = [f"device {device}", f"dtype {dtype}"]
    if section == "attention" and model is not None:  # MLA models need the "mla" feature, others not
        candidates = [i for i in candidates if ("mla" in i.cls.capabilities.features) == model.mla]
        fits.append(f"{'MLA' if model.mla else 'non-MLA'} model {model.model_type}")
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


def _check_layouts(chosen: Mapping[str, ResolvedBackend], source: str) -> None:
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
    lines = [f"{source}: {section}: invalid options for {info.family} backend {info.name!r} "
             f"(plugin {info.plugin})"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  {section}.{key}: unknown option (allowed: {allowed})")
        else:
            lines.append(f"  {section}.{key}: {err['msg']}{_got(err)}")
    return "\n".join(lines)
