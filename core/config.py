"""``EngineConfig``: the YAML file users write, validated entirely at load time.

Each plugin section names a backend (``backend:``, or ``method:`` for quant
and speculative) and its options; the options are validated by that
backend's pydantic ``Options`` model, so unknown keys and bad values fail
here, with the file, the key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from lmplug.errors import ConfigError
from lmplug.interfaces import BackendInfo, BackendOptions
from lmplug.plugins import Registry, get_registry

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"

# config section -> (plugin family, key that names the backend)
SECTIONS: dict[str, tuple[str, str]] = {
    "kvcache": ("kvcache", "backend"),
    "attention": ("attention", "backend"),
    "scheduler": ("scheduler", "backend"),
    "quant": ("quant", "method"),
    "speculative": ("drafter", "method"),
    "moe": ("moe", "backend"),
}
OPTIONAL_SECTIONS = {"quant", "speculative", "moe"}  # absent = feature off / not an MoE model


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
    seed: int = Field(default=0, description="seeds requests that give no seed of their own")
    attention: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    kvcache: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    scheduler: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    moe: dict[str, Any] | None = Field(default=None, description="MoE models only; see below")
    quant: dict[str, Any] | None = Field(default=None, description="absent: the checkpoint's own format")
    speculative: dict[str, Any] | None = Field(default=None, description="absent: no speculative decoding")
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
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of options at the top level, got {type(data).__name__}")
        return cls.from_dict(merge(data, overrides), source=str(path))

    @classmethod
    def default(cls, **overrides: Any) -> EngineConfig:
        return cls.from_yaml(DEFAULT_CONFIG, **overrides)


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
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


# -- choosing backends ------------------------------------------------------------------


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
    """The config with every section's backend chosen and its options validated."""

    config: EngineConfig
    device: str
    dtype: str
    # section -> backend: optional sections only when set, except `moe`, which the engine
    # build adds (`auto`) for a mixture-of-experts model, once the model is known
    backends: dict[str, ResolvedBackend]
    source: str = "config"  # where the config came from, for error messages


def resolve(config: EngineConfig, *, device: str, dtype: str,
            registry: Registry | None = None, source: str = "config") -> ResolvedConfig:
    """Choose every backend and validate its options. Raises ``ConfigError``."""
    registry = registry or get_registry()
    chosen: dict[str, ResolvedBackend] = {}
    for section in SECTIONS:
        if getattr(config, section) is not None:
            chosen[section] = resolve_section(config, section, device=device, dtype=dtype,
                                              registry=registry, chosen=chosen, source=source)
    _check_layouts(chosen, source)
    check_kv_dtype(chosen, source)
    return ResolvedConfig(config, device, dtype, chosen, source)


def resolve_section(config: EngineConfig, section: str, *, device: str, dtype: str,
                    registry: Registry | None = None, chosen: dict[str, ResolvedBackend] | None = None,
                    source: str = "config") -> ResolvedBackend:
    """Choose one section's backend and validate its options; an absent section is ``auto``
    (how the engine resolves ``moe`` for an MoE model). Raises ``ConfigError``."""
    family, name_key = SECTIONS[section]
    raw = dict(getattr(config, section) or {name_key: "auto"})
    name = raw.pop(name_key, "auto" if section in ("kvcache", "attention", "scheduler", "moe") else None)
    if name is None:
        raise ConfigError(f"{source}: {section}: missing `{name_key}` (which {family} to use)")
    info = _choose(registry or get_registry(), section, family, name, device, dtype, chosen or {}, source)
    try:
        options = info.cls.Options(**raw)
    except ValidationError as exc:
        raise ConfigError(_explain_section(exc, source, section, info)) from None
    return ResolvedBackend(info, options)


def _choose(registry: Registry, section: str, family: str, name: str, device: str, dtype: str,
            chosen: dict[str, ResolvedBackend], source: str) -> BackendInfo:
    if name != "auto":
        try:
            info = registry.get(family, name)
        except Exception as exc:
            raise ConfigError(f"{source}: {section}: {exc}") from None
        caps = info.cls.capabilities
        if not caps.fits(device, dtype):
            raise ConfigError(f"{source}: {section}: {family} backend {name!r} does not run on "
                              f"device {device!r} with dtype {dtype!r} ({caps.describe()})")
        return info
    candidates = [i for i in registry.backends(family).values() if i.cls.capabilities.fits(device, dtype)]
    if section == "attention" and "kvcache" in chosen:
        layout = _layout_of(chosen["kvcache"].info)
        candidates = [i for i in candidates if layout in i.cls.capabilities.kv_layouts]
        kv_dtype = kv_dtype_of(chosen["kvcache"])
        readers = [i for i in candidates if kv_dtype in i.cls.capabilities.kv_dtypes]
        if candidates and not readers:
            raise ConfigError(f"{source}: kvcache.dtype={kv_dtype!r}: no attention backend that fits "
                              f"device {device!r} and the {layout or 'chosen'} KV layout reads it "
                              f"(candidates: {', '.join(sorted(i.name for i in candidates))})")
        candidates = readers
    if not candidates:
        available = ", ".join(sorted(registry.backends(family))) or "none installed"
        raise ConfigError(f"{source}: {section}: no {family} backend fits device {device!r} and "
                          f"dtype {dtype!r} (installed: {available})")
    return max(candidates, key=lambda i: (i.cls.capabilities.priority, i.name))


def kv_dtype_of(kvcache: ResolvedBackend) -> str:
    """The kvcache backend's `dtype` option ("auto" for backends without one)."""
    return str(getattr(kvcache.options, "dtype", "auto"))


def check_kv_dtype(chosen: dict[str, ResolvedBackend], source: str) -> None:
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


def _check_layouts(chosen: dict[str, ResolvedBackend], source: str) -> None:
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
            lines.append(f"  {section}.{key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)
