"""Offline quantizers: read a float checkpoint, write a quantized one in a published format.

Unlike a ``QuantMethod`` (which loads and runs a quantized checkpoint inside
the engine), a ``Quantizer`` runs once, offline: ``lmplug quantize MODEL OUT
--method NAME`` hands it the opened float checkpoint, a folder to write and
the calibration settings, and it writes ``config.json`` (with a
``quantization_config`` that some ``QuantMethod`` reads), safetensors weights
and the tokenizer. The core never imports a quantizer; plugins register them
through ``lmplug_register_quantizers``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from lmplug.interfaces.common import BackendOptions, Capabilities

if TYPE_CHECKING:
    from lmplug.interfaces.checkpoint import ModelSource

# progress(stage, done, total): called as work proceeds; the CLI draws a bar or a line
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class CalibrationSpec:
    """How much calibration text a quantizer that needs activations should run:
    ``num_samples`` windows of ``seq_len`` tokens (the quantizer picks the text)."""

    num_samples: int = 32
    seq_len: int = 512


class Quantizer(ABC):
    """One offline method (``name``: what ``--method`` says). ``Options`` (pydantic, unknown keys
    rejected) holds what the method accepts: a CLI flag the method does not know is an error
    naming the flag."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities(devices=frozenset({"cpu"}))
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    needs_calibration: ClassVar[bool] = True

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @abstractmethod
    def quantize(self, model_source: ModelSource, out_dir: Path, calibration: CalibrationSpec,
                 progress: Progress) -> dict:
        """Write the quantized checkpoint into ``out_dir`` (an empty folder the caller renames
        into place when this returns). Returns a summary for the user (e.g. ``weight_bytes``,
        ``float_weight_bytes``, seconds per stage)."""
