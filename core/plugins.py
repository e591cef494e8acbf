"""The plugin manager: finds plugins through entry points and keeps the backend registry.

First-party plugins are found exactly like third-party ones, through the
entry-point group ``lmplug.plugins``. Environment:

- ``LMPLUG_PLUGINS=a,b``: load only these entry points (by entry-point or
  distribution name); a name that matches no entry point is reported (a warning
  naming the variable and the entry points there are, and ``Registry.allowlist_note``
  in "none installed" errors);
- ``LMPLUG_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point except those
  named in ``LMPLUG_PLUGINS``.

A plugin that fails to import (any exception, and also ``SystemExit``,
``KeyboardInterrupt`` or another ``BaseException`` raised by its import: contained
only while the plugin module imports), or targets another core API version, is
reported (``Registry.failures``, a warning, and in "unknown backend"
errors) and the others still load.
"""

from __future__ import annotations

import logging
import os
import re
import types
from dataclasses import dataclass
from typing import Any

import importlib_metadata
import pluggy

from lmplug import hookspecs
from lmplug.api import API_VERSION
from lmplug.errors import PluginError
from lmplug.families import FAMILIES, canonical
from lmplug.families import TABLE as FAMILY_TABLE
from lmplug.interfaces.common import BackendInfo, BackendOptions, Capabilities
from lmplug.kit.kv_extras import missing_mixins

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lmplug.plugins"
ENV_ALLOWLIST = "LMPLUG_PLUGINS"
ENV_DISABLE_AUTOLOAD = "LMPLUG_DISABLE_PLUGIN_AUTOLOAD"


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    distribution: str
    error: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} (distribution {self.distribution}): {self.error}"


class Registry:
    """name -> backend class, per extension point, built from the loaded plugins."""

    def __init__(self, *, autoload: bool = True) -> None:
        self.pm = pluggy.PluginManager("lmplug")
        self.pm.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self._distributions: dict[str, str] = {}  # plugin name -> distribution
        # family -> name -> backend, built family by family on first use: a plugin's
        # registration hook imports its backend modules, so a CPU generate imports no drafter,
        # MoE or offline-quantizer code unless its config names one
        self._backends: dict[str, dict[str, BackendInfo]] = {}
        self._callers: dict[str, list] = {}  # hook -> [(plugin, its subset hook caller)]
        self.allowlist_note = ""  # set when LMPLUG_PLUGINS names what no entry point is
        if autoload:
            self.load_entry_points()

    # -- loading ------------------------------------------------------------------
    def load_entry_points(self) -> None:
        allow = {s.strip() for s in os.environ.get(ENV_ALLOWLIST, "").split(",") if s.strip()}
        allow_dists = {_normalize(s) for s in allow}
        disabled = os.environ.get(ENV_DISABLE_AUTOLOAD, "").lower() not in ("", "0", "false", "no")
        matched: set[str] = set()
        entry_points = list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))
        for ep in entry_points:
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "?"
            dist_name = _normalize(ep.dist.name) if ep.dist else ""
            matched |= {a for a in allow if a == ep.name or _normalize(a) == dist_name}
            if allow and ep.name not in allow and dist_name not in allow_dists:
                continue
            if disabled and not allow:
                continue
            if self.pm.get_plugin(ep.name) is not None:
                other = self._distributions.get(ep.name, "?")
                if other != dist:  # the same distribution seen again is fine; a clash is not
                    self._fail(ep.name, dist, f"not loaded: the entry-point name {ep.name!r} is already "
                               f"taken by distribution {other}; rename one of the entry points")
                continue
            try:
                plugin = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a broken plugin must not take the others
                # down, nor end the process: SystemExit / KeyboardInterrupt raised by a plugin's
                # import are contained here, and only here (a Ctrl-C elsewhere still stops lmplug)
                self._fail(ep.name, dist, _import_failure(ep.value, exc))
                continue
            self.register(plugin, name=ep.name, distribution=dist)
        if allow - matched:
            self._note_unmatched(sorted(allow - matched), entry_points)

    def _note_unmatched(self, names: list[str], entry_points: list) -> None:
        available = ", ".join(sorted(f"{ep.name} ({ep.dist.name if ep.dist else '?'})" for ep in entry_points))
        self.allowlist_note = (f"{ENV_ALLOWLIST}={os.environ.get(ENV_ALLOWLIST, '')!r}: "
                               f"{', '.join(map(repr, names))} matches no entry point of group "
                               f"{ENTRY_POINT_GROUP!r} (entry points: {available or 'none'})")
        logger.warning("lmplug: %s", self.allowlist_note)

    def register(self, plugin: Any, *, name: str, distribution: str = "<in-process>") -> bool:
        """Register one plugin object after checking the API version it targets."""
        version = getattr(plugin, "LMPLUG_API_VERSION", None)
        if version is None:
            self._fail(name, distribution, "does not declare LMPLUG_API_VERSION "
                       f"(this core implements API version {API_VERSION})")
            return False
        if version != API_VERSION:
            self._fail(name, distribution, f"targets lmplug API version {version}, "
                       f"but this core implements API version {API_VERSION}")
            return False
        if type(plugin).__hash__ is None:  # pluggy's subset hook callers keep plugins in sets
            plugin = _as_module(plugin, name)
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - a broken plugin fails alone (pluggy reads it)
            self._fail(name, distribution, f"could not be registered: {exc}")
            return False
        # pluggy accepts any `lmplug_*` method; a misspelt hook would silently never run
        unknown = sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or []
                         if hc.spec is None and not all(i.optionalhook for i in hc.get_hookimpls()
                                                        if i.plugin is plugin))
        if unknown:
            self.pm.unregister(plugin)
            self._fail(name, distribution, f"implements unknown hook(s) {', '.join(unknown)} "
                       "(mark hooks of newer API versions `@hookimpl(optionalhook=True)`)")
            return False
        self._distributions[name] = distribution
        self._backends, self._callers = {}, {}
        return True

    def _fail(self, plugin: str, distribution: str, error: str) -> None:
        failure = PluginFailure(plugin, distribution, error)
        if failure in self.failures:  # e.g. found again when the backend table is rebuilt
            return
        self.failures.append(failure)
        logger.warning("lmplug: %s", failure)

    # -- calling hooks ------------------------------------------------------------------
    @property
    def hook(self):
        return self.pm.hook

    def distribution(self, plugin: str) -> str:
        """The distribution a registered plugin came from ("?" if unknown)."""
        return self._distributions.get(plugin, "?")

    def implementers(self, hook: str) -> list[str]:
        """The plugins with a (non-wrapper) implementation of ``hook``, in pluggy's call order."""
        impls = getattr(self.pm.hook, hook).get_hookimpls()
        return [i.plugin_name for i in reversed(impls) if not (i.hookwrapper or i.wrapper)]

    def call_each(self, hook: str, **kwargs: Any) -> list[tuple[str, Any, BaseException | None]]:
        """Call ``hook`` once per implementing plugin through pluggy's hook relay (every wrapper
        around each call), so one plugin's exception is its own: ``[(plugin, results, error)]``."""
        callers = self._callers.get(hook)
        if callers is None:
            names = self.implementers(hook)
            plugins = {n: self.pm.get_plugin(n) for n in names}
            callers = self._callers[hook] = [
                (n, self.pm.subset_hook_caller(hook, [p for m, p in plugins.items() if m != n]))
                for n in names]
        out: list[tuple[str, Any, BaseException | None]] = []
        for name, caller in callers:
            try:
                out.append((name, caller(**kwargs), None))
            except Exception as exc:  # noqa: BLE001 - attributed to the plugin by the caller
                out.append((name, None, exc))
        return out

    # -- the registry -----------------------------------------------------------------

    def backends(self, family: str) -> dict[str, BackendInfo]:
        family = canonical(family)
        if family not in FAMILIES:
            raise PluginError(f"unknown plugin family {family!r}; families: {', '.join(FAMILIES)}")
        if family not in self._backends:
            self._backends[family] = self._build(family)
        return self._backends[family]

    def get(self, family: str, name: str) -> BackendInfo:
        table = self.backends(family)
        if name in table:
            return table[name]
        available = ", ".join(sorted(table)) or "none"
        msg = f"unknown {family} backend {name!r}; available: {available}"
        if self.allowlist_note:
            msg += f" ({self.allowlist_note})"
        if self.failures:
            msg += ". Plugins that failed to load: " + "; ".join(map(str, self.failures))
        raise PluginError(msg)

    def _build(self, family: str) -> dict[str, BackendInfo]:
        """One family's table: call every plugin's registration hook of that family (and the
        hook's earlier names, which older plugins still implement)."""
        table: dict[str, BackendInfo] = {}
        for hook_name, (plugin, results, exc) in ((h, r) for h in _HOOKS[family] for r in self.call_each(h)):
            dist = self.distribution(plugin)
            if exc is not None:
                self._fail(plugin, dist, f"{hook_name} raised {type(exc).__name__}: {exc}")
                continue
            classes = results[0] if results else []  # one implementation: one result (None: none)
            if not isinstance(classes, (list, tuple)):
                self._fail(plugin, dist, f"{hook_name} must return a list of backend "
                           f"classes, got {classes!r}")
                continue
            for cls in classes:
                problem = _check_backend_class(family, cls)
                if problem:
                    self._fail(plugin, dist, problem)
                    continue
                info = BackendInfo(family, cls.name, cls, plugin, dist)
                if cls.name in table:
                    other = table[cls.name]
                    raise PluginError(
                        f"two {family} backends are named {cls.name!r}: one from plugin "
                        f"{other.plugin!r} (distribution {other.distribution}), one from plugin "
                        f"{plugin!r} (distribution {dist}); uninstall one or rename it")
                table[cls.name] = info
        return table


# family -> its registration hook and the hook's earlier names
_HOOKS = {f.name: (f.hook, *f.old_hooks) for f in FAMILY_TABLE}


def _as_module(plugin: Any, name: str) -> types.ModuleType:
    """An unhashable plugin object (a ``SimpleNamespace``, say) as a module of its attributes."""
    module = types.ModuleType(name)
    module.__dict__.update(vars(plugin))
    return module


def _normalize(dist_name: str) -> str:
    """PEP 503 name normalization: ``Foo.Bar_baz`` and ``foo-bar-baz`` are one distribution."""
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _check_backend_class(family: str, cls: Any) -> str | None:
    base = FAMILIES[family]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return f"returned {cls!r} for {family}, which is not a subclass of {base.__name__}"
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        return f"{family} backend {cls.__name__} has no `name`"
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        return f"{family} backend {cls.name!r} has no `capabilities` (a Capabilities record)"
    options = getattr(cls, "Options", None)
    if not (isinstance(options, type) and issubclass(options, BackendOptions)):
        return f"{family} backend {cls.name!r}: `Options` must subclass lmplug.BackendOptions"
    missing = missing_mixins(cls, cls.capabilities.features) if family == "kvcache" else []
    if missing:
        return (f"kvcache backend {cls.name!r} lists features without their mixin of lmplug.kit.kv_extras: "
                f"{', '.join(missing)}; add the mixin to its bases or drop the feature")
    return None


_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    if _registry is None:
        _registry = Registry()
    return _registry


def reset_registry() -> None:
    """Forget the process-wide registry (tests; after installing a plugin at run time)."""
    global _registry
    _registry = None


def _import_failure(target: str, exc: BaseException) -> str:
    """Why a plugin module did not import. A plugin written for API version 1 imported engine
    internals that API 2 moved into the contract, one of API 2 names API 3 moved into ``lmplug.api``
    or the kit: say that, not just the ImportError."""
    missing = getattr(exc, "name", None) or ""
    if isinstance(exc, ImportError) and (missing == "lmplug" or missing.startswith("lmplug.")):
        return (f"targets an older lmplug API: importing {target!r} failed on {missing!r} "
                f"({type(exc).__name__}: {exc}); this core implements API version {API_VERSION}, in "
                "which plugins import the API from lmplug.api (and lmplug.errors) and building "
                "helpers from the kit lmplug.kit (docs/plugins.md, \"Porting a plugin\")")
    if not isinstance(exc, Exception):
        return (f"failed to import {target!r}: it raised {type(exc).__name__}({exc!s}) while importing "
                "(contained: a plugin's import may not end the process)")
    return f"failed to import {target!r}: {type(exc).__name__}: {exc}"
