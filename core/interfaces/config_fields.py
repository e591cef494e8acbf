"""Typed reads of an HF ``config.json``: each bad value is a ``ModelLoadError`` naming the file and key.

Numbers must already have their type: an integer field takes a JSON integer (``"64"``, ``64.0``,
``64.5`` and ``true`` are refused, not coerced), a float field a finite JSON number. Sizes are
positive and bounded (``BOUNDS``), so a hostile config fails here, before anything is built.
"""

from __future__ import annotations

import math
from typing import Any

from lmplug.errors import ModelLoadError

MAX_DEPTH = 32  # nesting of objects/arrays in a config.json (real ones nest 3-4 deep)
# upper bounds of sizes: several times the largest published model's value, far below what
# would exhaust memory or time before the memory check can run
BOUNDS = {
    "num_hidden_layers": 1024, "vocab_size": 1 << 22, "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "head_dim": 4096, "max_position_embeddings": 1 << 24,
    "sliding_window": 1 << 24, "num_experts": 4096, "num_local_experts": 4096, "n_routed_experts": 4096,
}
DEFAULT_BOUND = 1 << 20
_REQUIRED = object()


class ConfigReader:
    """Reads fields of one config dict; ``where`` (the file) prefixes every error."""

    def __init__(self, cfg: dict[str, Any], where: str = "config.json"):
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        self.cfg, self.where = cfg, where

    def fail(self, key: str, problem: str) -> None:
        raise ModelLoadError(f"{self.where}: {key!r} {problem}")

    def _get(self, key: str, default: Any) -> tuple[bool, Any]:
        """(found, value): a missing or null key with a default gives (False, default)."""
        value = self.cfg.get(key)
        if value is None:
            if default is _REQUIRED:
                self.fail(key, "is missing" if key not in self.cfg else "is null; it must be set")
            return False, default
        return True, value

    def int(self, key: str, default: Any = _REQUIRED, *, low: int = 1, high: int | None = None) -> Any:
        found, value = self._get(key, default)
        if not found:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"must be an integer, got {_show(value)}")
        high = BOUNDS.get(key, DEFAULT_BOUND) if high is None else high
        if value < low:
            self.fail(key, f"must be at least {low}, got {value}")
        if value > high:
            self.fail(key, f"is {value}, above lmplug's bound of {high}")
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, positive: bool = True) -> Any:
        found, value = self._get(key, default)
        if not found:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be a number, got {_show(value)}")
        if not math.isfinite(value) or (positive and value <= 0):
            self.fail(key, f"must be a finite {'positive ' if positive else ''}number, got {value}")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        found, value = self._get(key, default)
        if found and not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {_show(value)}")
        return value

    def mapping(self, key: str) -> dict[str, Any] | None:
        """An optional JSON object (null, absent or ``{}``: None)."""
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, dict):
            self.fail(key, f"must be an object (or null), got {_show(value)}")
        return value or None

    def text(self, key: str, default: str | None = None) -> str | None:
        found, value = self._get(key, default)
        if found and not isinstance(value, str):
            self.fail(key, f"must be a string, got {_show(value)}")
        return value


def check_depth(cfg: dict[str, Any], where: str) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, int, str]] = [(v, 1, k) for k, v in cfg.items()]
    while stack:
        value, depth, top = stack.pop()
        if depth > MAX_DEPTH:
            raise ModelLoadError(f"{where}: {top!r} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, dict):
            stack.extend((v, depth + 1, top) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1, top) for v in value)


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} (a {type(value).__name__})"
