"""``EngineConfig``: the YAML file users write, validated entirely at load time.

Each plugin section names a backend (``backend:``, or ``method:`` for quant
and speculative) and its options; the options are validated by that
backend's pydantic ``Options`` model, so unknown keys and bad values fail
here, with the file, the key, the value and what is allowed. ``resolve`` turns
the config into a ``ResolvedConfig``, one section at a time
(``lmplug.config_sections``: named or ``auto`` backends, nested families, the
checks across attention and the KV cache).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lmplug.config_sections import (
    ModelFacts,
    ResolvedBackend,
    check_kv_dtype,
    check_layouts,
    got,
    kv_dtype_of,  # noqa: F401  (imported from here by lmplug.engine.plan)
    resolve_nested,
    resolve_one,
)
from lmplug.errors import ConfigError
from lmplug.families import configured, nested
from lmplug.plugins import Registry, get_registry

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB; refuse anything larger before reading it

# config section -> (plugin family, key that names the backend), in resolution order; from the
# family table (``lmplug.families``)
SECTIONS: dict[str, tuple[str, str]] = {f.section: (f.name, f.name_key) for f in configured()}
# absent = feature off / not an MoE model
OPTIONAL_SECTIONS = frozenset(f.section for f in configured() if f.optional)
# a section's earlier name -> its name: both load the same config; the old one warns, once
SECTION_ALIASES: dict[str, str] = {alias: f.section for f in configured() for alias in f.aliases}
_warned_aliases: set[str] = set()


def canonical_sections(data: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """``data`` with every section under its one name (an old name renamed, with a deprecation
    warning logged once per process); both names at once is an error naming them."""
    out = dict(data)
    for alias, section in SECTION_ALIASES.items():
        if alias not in out:
            continue
        if section in out:
            raise ConfigError(f"{source}: `{alias}` is the old name of the section `{section}`; "
                              f"give it once, as `{section}`")
        out[section] = out.pop(alias)
        if alias not in _warned_aliases:
            _warned_aliases.add(alias)
            logger.warning("config section `%s` is deprecated: it is now `%s` (the %s family); the old "
                           "name loads the same config", alias, section, SECTIONS[section][0])
    return out


class ParallelConfig(BaseModel):
    """``parallel:``: tensor and pipeline parallelism (checked against the model's heads, sizes and
    layers at load; ``docs/parallel.md``)."""

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
    pipeline_parallel_size: int = Field(
        default=1, ge=1, description="pipeline stages the decoder layers are split into (contiguous layers "
        "per stage, each stage on its own `tensor_parallel_size` ranks: pipeline_parallel_size x "
        "tensor_parallel_size processes); must not exceed the model's layers")
    pipeline_layers: list[int] | None = Field(
        default=None, description="layers per pipeline stage, first stage first (one entry per stage, each "
        ">= 1, summing to the model's layers); unset: an even split, the remainder to the first stages")
    timeout_s: float = Field(default=300.0, gt=0, description="longest wait in one collective before the "
                             "group gives up (a dead worker is detected at once)")


class CpuConfig(BaseModel):
    """``cpu:``: the CPU fast paths, decided in the engine plan (``lmplug.engine.plan.cpu_policy``);
    the environment variables named below override a key when set (benchmarks compare paths)."""

    model_config = ConfigDict(extra="forbid")
    native_step: bool = Field(
        default=True, description="run a float32 decode step's decoder layers in one C call where every "
        "plugin on the path has a C form (else the Python layers); `LMPLUG_NATIVE_STEP=0|1` overrides")
    fused_ops: bool = Field(
        default=True, description="fused float32 CPU ops (RMSNorm, add + RMSNorm, SiLU * mul, RoPE in C; "
        "for the whole process); `LMPLUG_FUSED_CPU=0|1` overrides")


class PoolerConfig(BaseModel):
    """``pooler:``: how embedding requests (``LLM.embed``, ``/v1/embeddings``) pool the final hidden
    states, by default (vLLM's ``PoolerConfig`` / ``--override-pooler-config``)."""

    model_config = ConfigDict(extra="forbid")

    pooling_type: Literal["auto", "last", "mean", "cls"] = Field(
        default="auto", description="last: the last prompt token's hidden state (what a causal model's "
        "embedding is); mean: the average over the prompt's tokens; cls: the first token's; auto: the "
        "checkpoint's sentence-transformers Pooling module (modules.json) where it has one, else last")
    normalize: bool | None = Field(default=None, description="scale each embedding to unit L2 norm; "
                                   "None: as the checkpoint's sentence-transformers modules say (a Normalize "
                                   "module), else true")


class EngineConfig(BaseModel):
    """Everything one engine is built from."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="model name in the cache, HF folder, or .gguf file")
    tokenizer: str | None = Field(default=None, description="tokenizer folder/file if not the model's")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="weights and activations; auto: float32 on CPU, bfloat16 on CUDA")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when available")
    model_impl: str = Field(
        default="auto", min_length=1, max_length=64,
        description="the architecture that runs the checkpoint (`model` family, `lmplug plugins`): auto "
        "(the highest-priority native architecture serving its config.json, else the transformers "
        "fallback), native (never the fallback), transformers (always the fallback), or an architecture's name")
    max_model_len: int | None = Field(default=None, ge=1, description="context limit; default: the model's")
    seed: int = Field(default=0, ge=0, le=2**64 - 1,
                      description="seeds requests that give no seed of their own (0 to 2**64-1)")
    attention: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    kvcache: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    kvconnector: dict[str, Any] | None = Field(
        default=None, description="absent: KV blocks stay in the pool; a tier for prefix-cached blocks")
    scheduler: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"}, description="see below")
    moe: dict[str, Any] | None = Field(default=None, description="MoE models only; see below")
    mixer: dict[str, Any] | None = Field(
        default=None, description="models with linear-attention / state-space layers only; see below")
    quant: dict[str, Any] | None = Field(default=None, description="absent: the checkpoint's own format")
    speculative: dict[str, Any] | None = Field(default=None, description="absent: no speculative decoding")
    constraint: dict[str, Any] = Field(
        default_factory=lambda: {"backend": "auto"},
        description="the grammar engine for structured output and forced tool calls (formerly "
        "`structured_output`, still accepted); see below")
    lora: dict[str, Any] | None = Field(
        default=None, description="absent: no LoRA adapters; present: how many are served at once (see below)")
    compression: dict[str, Any] | None = Field(
        default=None, description="absent: no prompt compression; present: the default for every request")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="tensor and pipeline parallelism")
    pooler: PoolerConfig = Field(default_factory=PoolerConfig, description="embeddings' default pooling")
    cpu: CpuConfig = Field(default_factory=CpuConfig, description="the CPU fast paths (native step, fused ops)")

    @model_validator(mode="before")
    @classmethod
    def _old_section_names(cls, data: Any) -> Any:
        return canonical_sections(data) if isinstance(data, Mapping) else data

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
        if isinstance(data, Mapping):
            data = canonical_sections(data, source)
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
    """Overrides win; plugin sections merge key by key (a new backend name drops old options).
    A section's old name merges into its new one."""
    out = canonical_sections(base)
    for key, value in canonical_sections(overrides).items():
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
            lines.append(f"  {key}: {err['msg']}{got(err)}")
    return "\n".join(lines)


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
        needed = model is not None and ((section == "moe" and model.moe) or (section == "mixer" and model.states))
        if getattr(config, section) is not None or needed:
            chosen[section], reasons[section] = resolve_one(
                section, getattr(config, section), device=device, dtype=dtype, registry=registry,
                chosen=chosen, source=source, model=model)
    for family in nested():  # e.g. speculative.acceptance, once its parent section is set
        key = f"{family.within}.{family.name}"
        raw = (getattr(config, family.within) or {}).get(family.name)
        if family.within in chosen and raw is not None:
            chosen[key] = resolve_nested(raw, family, key, device=device, dtype=dtype, registry=registry,
                                         source=source)
            reasons[key] = "named in the config"
    if model is not None and not model.moe and "moe" in chosen:
        logger.warning("%s: moe: ignored, a %s model has no mixture-of-experts layers", source, model.model_type)
        del chosen["moe"], reasons["moe"]
    if model is not None and not model.states and "mixer" in chosen:
        logger.warning("%s: mixer: ignored, a %s model has no linear-attention or state-space layers",
                       source, model.model_type)
        del chosen["mixer"], reasons["mixer"]
    check_layouts(chosen, source)
    check_kv_dtype(chosen, source)
    return ResolvedConfig(config, device, dtype, chosen, source, reasons, model, registry)


def resolve_section(config: EngineConfig, section: str, *, device: str, dtype: str,
                    registry: Registry | None = None, chosen: Mapping[str, ResolvedBackend] | None = None,
                    source: str = "config", model: ModelFacts | None = None) -> ResolvedBackend:
    """Choose one section's backend and validate its options; an absent section is ``auto``
    where the family has it. Raises ``ConfigError``."""
    return resolve_one(section, getattr(config, section), device=device, dtype=dtype,
                       registry=registry or get_registry(), chosen=chosen or {}, source=source, model=model)[0]
