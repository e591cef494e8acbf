"""The one table of plugin families: every other list of them derives from ``TABLE``.

A family is an extension point: a base class (the contract), the registration hook plugins
implement to hand in their classes, and, for the families a user configures, the config
section and the key in it that names the backend. Derived from this table:

- ``FAMILIES`` (family -> base class) and the registry (``lmplug.plugins``:
  which hook fills which family, which base class each returned class must subclass);
- ``lmplug.config``: the plugin sections of ``EngineConfig`` (``SECTIONS``, ``OPTIONAL_SECTIONS``),
  which accept ``auto``, and the order they are resolved in;
- the generated docs (``docs/gen_config.py``, ``docs/gen_hooks.py``).

A family chosen inside another family's section (``within``: the acceptance rule, a key
``acceptance`` of the ``speculative`` section) has no section of its own; ``nested()`` lists
them and ``lmplug.config`` resolves them after their parent.

The hook specifications themselves stay plain functions in ``lmplug.hookspecs`` (pluggy reads
their signatures); a test checks that every ``hook`` below is one of them and every
registration spec there has a row here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from lmplug.interfaces.acceptance import AcceptanceRule
from lmplug.interfaces.adapter import AdapterBackend
from lmplug.interfaces.architecture import Architecture
from lmplug.interfaces.attention import AttentionBackend
from lmplug.interfaces.compressor import Compressor
from lmplug.interfaces.constraint import ConstraintBackend
from lmplug.interfaces.drafter import Drafter
from lmplug.interfaces.kvcache import KVCacheBackend
from lmplug.interfaces.kvconnector import KVConnector
from lmplug.interfaces.mixer import MixerBackend
from lmplug.interfaces.moe import MoEBackend
from lmplug.interfaces.quant import QuantMethod
from lmplug.interfaces.quantizer import Quantizer
from lmplug.interfaces.scheduler import Scheduler


@dataclass(frozen=True)
class Family:
    """One extension point."""

    name: str  # the registry's family name (``lmplug plugins``, ``Registry.backends(name)``)
    base: type  # every registered class subclasses it
    hook: str  # the registration hook (``lmplug.hookspecs``) that returns the classes
    section: str | None = None  # the ``EngineConfig`` section that chooses one; None: not configured
    name_key: str = "backend"  # the key of that section naming the backend (``backend`` / ``method``)
    auto: bool = False  # a section without the key means ``auto`` (chosen by capabilities)
    optional: bool = False  # an absent section is off (or, moe and mixer, decided by the model)
    after: tuple[str, ...] = ()  # sections resolved first: this one's ``auto`` reads their choice
    # chosen by the key ``name`` inside this section (e.g. ``speculative: {acceptance: {rule: ...}}``)
    within: str | None = None
    # earlier names of ``section`` that still load the same config (deprecated: a warning, once)
    aliases: tuple[str, ...] = ()
    # earlier names of the family (the registry and ``lmplug.testing`` still accept them, with a
    # deprecation warning) and of its registration hook (still called; pluggy warns its implementers)
    old_names: tuple[str, ...] = ()
    old_hooks: tuple[str, ...] = ()


TABLE: tuple[Family, ...] = (
    Family("attention", AttentionBackend, "lmplug_register_attention_backends", "attention",
           auto=True, after=("kvcache",)),
    Family("kvcache", KVCacheBackend, "lmplug_register_kvcache_backends", "kvcache", auto=True),
    Family("kvconnector", KVConnector, "lmplug_register_kvconnectors", "kvconnector", optional=True),
    Family("scheduler", Scheduler, "lmplug_register_schedulers", "scheduler", auto=True),
    Family("quant", QuantMethod, "lmplug_register_quant_methods", "quant", "method", optional=True),
    Family("speculative", Drafter, "lmplug_register_speculative_methods", "speculative", "method", optional=True,
           old_names=("drafter",), old_hooks=("lmplug_register_drafters",)),  # rename_concepts: keep
    Family("acceptance", AcceptanceRule, "lmplug_register_acceptance_rules", name_key="rule",
           within="speculative"),
    Family("moe", MoEBackend, "lmplug_register_moe_backends", "moe", auto=True, optional=True),
    Family("mixer", MixerBackend, "lmplug_register_mixer_backends", "mixer", auto=True, optional=True),
    Family("constraint", ConstraintBackend, "lmplug_register_constraint_backends", "constraint",
           auto=True, aliases=("structured_output",)),
    # LoRA adapters served beside the base weights; absent: none
    Family("adapter", AdapterBackend, "lmplug_register_adapter_backends", "lora", auto=True, optional=True),
    Family("compression", Compressor, "lmplug_register_compression_methods", "compression", "method",
           optional=True, old_names=("compressor",), old_hooks=("lmplug_register_compressors",)),  # rename_concepts: keep
    Family("quantizer", Quantizer, "lmplug_register_quantizers"),
    # chosen by the top-level key ``model_impl`` from what serves the checkpoint (``engine.plan``)
    Family("model", Architecture, "lmplug_register_architectures"),
)

BY_NAME: dict[str, Family] = {f.name: f for f in TABLE}


def configured() -> tuple[Family, ...]:
    """The families with a config section, in resolution order (each after its ``after``)."""
    out: list[Family] = []

    def visit(family: Family) -> None:
        if family in out:
            return
        for section in family.after:
            visit(next(f for f in TABLE if f.section == section))
        out.append(family)

    for family in TABLE:
        if family.section is not None:
            visit(family)
    return tuple(out)


def nested() -> tuple[Family, ...]:
    """The families chosen inside another family's section (``within``)."""
    return tuple(f for f in TABLE if f.within is not None)


def by_section(section: str) -> Family:
    return next(f for f in TABLE if f.section == section)


# a family's earlier name -> its name (one name per concept: section, family, hook and package agree)
OLD_NAMES: dict[str, str] = {old: f.name for f in TABLE for old in f.old_names}


def canonical(name: str) -> str:
    """``name``, or the family's current name when ``name`` is an earlier one (a deprecation warning)."""
    if name in OLD_NAMES:
        warnings.warn(f"plugin family {name!r} is now {OLD_NAMES[name]!r}", DeprecationWarning, stacklevel=3)
        return OLD_NAMES[name]
    return name

# family name -> base class; the registry and config use these names.
FAMILIES: dict[str, type] = {f.name: f.base for f in TABLE}
