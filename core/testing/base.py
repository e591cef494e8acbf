"""What every family's conformance class shares: naming the backend, options, device, dtypes.

A plugin author subclasses a family's class and sets class attributes::

    class TestMyAttention(AttentionConformance):
        backend = "mine"              # a registered name (found through entry points) ...
        # backend_cls = MyAttention   # ... or the class itself
        options = {"block_k": 32}     # the backend's YAML section, validated by its Options
        dtypes = ["float32"]          # default: every dtype the backend claims

Test parameters (batch specs, dtypes, ...) come from ``params_<argname>``
methods, read by the class's ``pytest_generate_tests``; anything the backend
does not claim in its ``Capabilities`` is shown as skipped, with the reason.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest
from pydantic import ValidationError

from lmplug.api import BackendOptions, Capabilities
from lmplug.families import FAMILIES
from lmplug.testing.compare import DTYPES, fail

ALL_DTYPES = list(DTYPES)


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


class Conformance:
    pytestmark = pytest.mark.lmplug_conformance

    family: ClassVar[str] = ""
    backend: ClassVar[str | None] = None
    backend_cls: ClassVar[type | None] = None
    options: ClassVar[dict[str, Any]] = {}
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[list[str] | None] = None
    # Triton's interpreter computes tl.dot on bf16 operands wrongly; a Triton backend sets this
    # so that bf16 cases are skipped (with that reason) under TRITON_INTERPRET=1 and run on GPUs.
    skip_bf16_under_triton_interpreter: ClassVar[bool] = False
    # the claimed features to exercise (default: all of capabilities.features); narrow it when a
    # feature is switched by an option the test does not set, e.g. prefix caching
    features: ClassVar[frozenset[str] | set[str] | None] = None
    # test name pattern ("*" matches anything, e.g. "test_kv_written*[*-paged-*]") -> why it fails
    # today; those tests are expected to fail (strict xfail: once fixed, the entry must go)
    known_failures: ClassVar[dict[str, str]] = {}

    # -- which backend -------------------------------------------------------------------------
    @classmethod
    def resolve_backend(cls) -> tuple[type | None, str | None]:
        """(backend class, None), or (None, why it cannot be found)."""
        if cls.backend_cls is not None:
            return cls.backend_cls, None
        if not cls.backend:
            return None, (
                f'{cls.__name__}: set `backend = "<name>"` (a registered {cls.family} '
                f"backend) or `backend_cls = <class>`"
            )
        from lmplug.plugins import get_registry

        try:
            return get_registry().get(cls.family, cls.backend).cls, None
        except Exception as exc:  # noqa: BLE001 - PluginError, or a registry broken by some plugin
            return None, f"{cls.__name__}: {exc}"

    @classmethod
    def backend_name(cls) -> str:
        found, _ = cls.resolve_backend()
        return getattr(found, "name", None) or cls.backend or "?"

    @classmethod
    def claimed(cls) -> Capabilities | None:
        found, _ = cls.resolve_backend()
        caps = getattr(found, "capabilities", None)
        return caps if isinstance(caps, Capabilities) else None

    @classmethod
    def label(cls) -> str:
        return f"{cls.family} backend {cls.backend_name()!r}"

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def backend_class(cls) -> type:
        found, problem = cls.resolve_backend()
        if problem:
            fail(problem)
        return found

    @pytest.fixture(scope="class")
    @classmethod
    def backend_options(cls, backend_class) -> BackendOptions:
        try:
            return backend_class.Options(**cls.options)
        except ValidationError as exc:
            fail(
                f"{cls.label()}: options {cls.options!r} are not valid for its Options model "
                f"{backend_class.Options.__name__}:\n{exc}"
            )

    @pytest.fixture(autouse=True)
    def _device_available(self, backend_class) -> None:
        caps = backend_class.capabilities
        if isinstance(caps, Capabilities) and self.device not in caps.devices | caps.named_devices:
            pytest.skip(
                f"{self.label()} does not claim device {self.device!r} "
                f"(capabilities.devices = {sorted(caps.devices | caps.named_devices)})"
            )
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                pytest.skip(f"device {self.device!r} requested but no CUDA device is available")

    # -- parametrization -----------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        for argname in metafunc.fixturenames:
            make = getattr(self, f"params_{argname}", None)
            if make is not None:
                # class scope: tests sharing a class-scoped fixture (one forward per case) are
                # grouped by parameter, so each case is computed once
                metafunc.parametrize(argname, make(), scope="class")

    def params_dtype(self) -> list:
        caps = self.claimed()
        out = []
        for name in self.dtypes or ALL_DTYPES:
            out.append(pytest.param(name, id=name, marks=self._dtype_marks(name, caps)))
        return out

    def _dtype_marks(self, name: str, caps: Capabilities | None) -> list:
        if caps is not None and name not in caps.dtypes:
            return [
                pytest.mark.skip(
                    reason=f"{self.label()} does not claim dtype {name} "
                    f"(capabilities.dtypes = {sorted(caps.dtypes)})"
                )
            ]
        if name == "bfloat16" and self.skip_bf16_under_triton_interpreter and interpreter_on():
            return [
                pytest.mark.skip(
                    reason="bf16 tl.dot is wrong under TRITON_INTERPRET=1; "
                    "the backend runs bf16 cases on a GPU only"
                )
            ]
        return []

    @classmethod
    def exercised_features(cls, caps: Capabilities) -> frozenset[str]:
        return caps.features if cls.features is None else caps.features & frozenset(cls.features)

    @classmethod
    def missing_features(cls, caps: Capabilities, needed: frozenset[str] | set[str]) -> str | None:
        """Why a check needing ``needed`` is skipped, or None when it runs."""
        missing = sorted(set(needed) - cls.exercised_features(caps))
        if not missing:
            return None
        if set(missing) <= caps.features:
            return (
                f"{cls.label()}: {', '.join(missing)} not exercised by this test class "
                f"(features = {sorted(cls.exercised_features(caps))})"
            )
        return (
            f"{cls.label()} does not claim {', '.join(missing)} "
            f"(capabilities.features = {sorted(caps.features)})"
        )

    def feature_marks(self, needed: frozenset[str] | set[str]) -> list:
        caps = self.claimed()
        reason = self.missing_features(caps, needed) if caps is not None else None
        return [pytest.mark.skip(reason=reason)] if reason else []

    def require_features(self, backend_class: type, *needed: str) -> None:
        """Skip the running test unless every feature in ``needed`` is exercised."""
        reason = self.missing_features(backend_class.capabilities, set(needed))
        if reason:
            pytest.skip(reason)

    # -- the declaration itself ------------------------------------------------------------------
    def test_backend_declaration(self, backend_class) -> None:
        """Name, capabilities and Options as the registry requires, and the options given validate."""
        problems = declaration_problems(self.family, backend_class)
        if (
            self.backend
            and backend_class is not None
            and getattr(backend_class, "name", None) != self.backend
        ):
            problems.append(
                f"the class is named {backend_class.name!r}, but the test asks for "
                f"backend {self.backend!r}"
            )
        problems += self.extra_declaration_problems(backend_class)
        if problems:
            fail(f"{self.label()} is not declared correctly:\n  - " + "\n  - ".join(problems))

    def extra_declaration_problems(self, backend_class: type) -> list[str]:
        return []


def declaration_problems(family: str, cls: type) -> list[str]:
    problems = []
    base = FAMILIES[family]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return [f"{cls!r} is not a subclass of lmplug.{base.__name__}"]
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        problems.append("`name` must be a non-empty string (the name users write in YAML)")
    caps = getattr(cls, "capabilities", None)
    if not isinstance(caps, Capabilities):
        problems.append("`capabilities` must be an lmplug.Capabilities record")
    else:
        unknown = sorted(set(caps.dtypes) - set(ALL_DTYPES))
        if unknown:
            problems.append(
                f"capabilities.dtypes has unknown dtypes {unknown}; known: {ALL_DTYPES}"
            )
        if not caps.devices:
            problems.append("capabilities.devices is empty")
    options = getattr(cls, "Options", None)
    if not (isinstance(options, type) and issubclass(options, BackendOptions)):
        problems.append("`Options` must subclass lmplug.BackendOptions")
    elif options.model_config.get("extra") != "forbid":
        problems.append("`Options` must reject unknown keys (keep BackendOptions' extra='forbid')")
    return problems
