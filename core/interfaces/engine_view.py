"""``EngineView``: what the lifecycle hooks hand an observer plugin of a running engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lmplug.interfaces.model_config import ModelConfig


class EngineView:
    """Read-only facts of one engine (its config, the backend chosen per family, the model's
    facts, the context limit, the last step's statistics), never its parts: an observer cannot
    reach the cache, the scheduler or the model, which the engine's stages own."""

    __slots__ = ("_backends", "_config", "_max_model_len", "_model_config", "_stats")

    def __init__(self, config: Any, backends: Mapping[str, str], model_config: ModelConfig,
                 max_model_len: int, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._config = config
        self._backends = MappingProxyType(dict(backends))
        self._model_config = model_config
        self._max_model_len = max_model_len
        self._stats = stats

    @property
    def config(self) -> Any:
        """The validated ``EngineConfig`` the engine was started with."""
        return self._config

    @property
    def backends(self) -> Mapping[str, str]:
        """Family -> the backend chosen for this model (e.g. ``{"attention": "sdpa", ...}``)."""
        return self._backends

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    @property
    def max_model_len(self) -> int:
        """The context limit the plan fitted to the KV pool."""
        return self._max_model_len

    @property
    def stats(self) -> dict[str, Any]:
        """A copy of the last step's statistics (``lmplug_step_finished``'s); empty before one."""
        return dict(self._stats())

    def __repr__(self) -> str:
        return f"EngineView(model={getattr(self._config, 'model', None)!r}, backends={dict(self._backends)})"
