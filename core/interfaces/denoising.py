"""``DenoisingParams``: how a block-diffusion model (DiffusionGemma) denoises each canvas.

The defaults are transformers' (``DiffusionGemmaGenerationConfig``): up to 48 denoising steps, a
linear temperature schedule from ``t_max`` (first step) down to ``t_min``, the entropy-bound
sampler accepting the lowest-entropy tokens while their summed entropy less the largest stays
within ``entropy_bound``, and an early stop once the argmax canvas has held for
``stability_threshold`` steps and the mean entropy is below ``confidence_threshold``. Bad values
fail when the params are made (``ConfigError`` naming ``denoising.<field>``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmplug.errors import ConfigError

MAX_DENOISING_STEPS = 1024


@dataclass(frozen=True)
class DenoisingParams:
    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1  # 0: stable at once (the confidence alone decides)
    confidence_threshold: float = 0.005
    # the canvas: the model's (config.json ``canvas_length``); a request may only restate it
    canvas_length: int | None = None

    def __post_init__(self) -> None:
        _check(_int(self.max_denoising_steps) and 1 <= self.max_denoising_steps <= MAX_DENOISING_STEPS,
               "max_denoising_steps", self.max_denoising_steps, f"an integer in [1, {MAX_DENOISING_STEPS}]")
        _check(_number(self.t_min) and self.t_min >= 0, "t_min", self.t_min, "a finite number >= 0")
        _check(_number(self.t_max) and self.t_max > self.t_min, "t_max", self.t_max,
               f"a finite number above t_min ({self.t_min})")
        _check(_number(self.entropy_bound) and self.entropy_bound > 0, "entropy_bound", self.entropy_bound,
               "a finite number > 0")
        _check(_int(self.stability_threshold) and 0 <= self.stability_threshold <= MAX_DENOISING_STEPS,
               "stability_threshold", self.stability_threshold, f"an integer in [0, {MAX_DENOISING_STEPS}]")
        _check(_number(self.confidence_threshold) and self.confidence_threshold > 0, "confidence_threshold",
               self.confidence_threshold, "a finite number > 0")
        _check(self.canvas_length is None or (_int(self.canvas_length) and self.canvas_length >= 1),
               "canvas_length", self.canvas_length, "None or an integer >= 1 (the model's canvas)")

    @classmethod
    def coerce(cls, value: object) -> DenoisingParams | None:
        """``value`` itself, None, or the params of a dict of fields (unknown keys named)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"denoising: expected a mapping of {', '.join(_FIELDS)}; got {type(value).__name__}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"denoising: unknown field(s) {', '.join(map(repr, unknown))}; "
                              f"expected some of {', '.join(_FIELDS)}")
        return cls(**value)


_FIELDS = ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
           "confidence_threshold", "canvas_length")


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"denoising.{name}={value!r} is invalid: expected {expected}")
