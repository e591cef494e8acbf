"""Pieces shared by every extension point: capabilities and options."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once as data (not as ``supports_*`` methods).

    ``priority`` orders candidates when the config says ``backend: auto``; the
    highest-priority backend whose capabilities fit the device, dtype and the
    other chosen backends wins. ``named_devices``: devices it also runs on when the config names
    it, which ``auto`` never picks it for (Triton kernels on a CPU under ``TRITON_INTERPRET``), so
    ``auto``'s order is the same with or without the interpreter.
    """

    devices: frozenset[str] = frozenset({"cpu"})
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    # KV layouts: for a kvcache backend the one it provides; for attention the ones it reads.
    kv_layouts: frozenset[str] = frozenset()
    # Free-form feature names, e.g. "sliding_window", "mla", "prefix_caching", "preemption".
    features: frozenset[str] = frozenset()
    # attention only: the kvcache `dtype` values it reads ("auto" = the model dtype; "int8" and
    # "fp8_e4m3" = quantized K/V with per-(token, head) scales, KVLayerView.k_scale / v_scale)
    kv_dtypes: frozenset[str] = frozenset({"auto"})
    priority: int = 0
    named_devices: frozenset[str] = frozenset()

    def fits(self, device: str, dtype: str, *, auto: bool = False) -> bool:
        """Runs on ``device`` in ``dtype``; ``auto``: and may be chosen there by ``backend: auto``."""
        devices = self.devices if auto else self.devices | self.named_devices
        return device in devices and dtype in self.dtypes

    def describe(self) -> str:
        parts = [f"devices={','.join(sorted(self.devices | self.named_devices))}",
                 f"dtypes={','.join(sorted(self.dtypes))}"]
        if self.kv_layouts:
            parts.append(f"kv_layouts={','.join(sorted(self.kv_layouts))}")
        if self.features:
            parts.append(f"features={','.join(sorted(self.features))}")
        if self.kv_dtypes != {"auto"}:
            parts.append(f"kv_dtypes={','.join(sorted(self.kv_dtypes))}")
        return " ".join(parts)


class BackendOptions(BaseModel):
    """Base of every backend's YAML section. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class BackendInfo:
    """A registered backend: its family, name, class and where it came from."""

    family: str
    name: str
    cls: type
    plugin: str
    distribution: str = field(default="?")
