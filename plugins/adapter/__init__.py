"""lmplug_adapter: the LoRA math of a batch whose rows each have their own adapter (torch, triton)."""

from __future__ import annotations

from lmplug_adapter.torch_lora import TorchLoRA
from lmplug_adapter.triton_lora import TritonLoRA

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_adapter_backends() -> list[type]:
    return [TorchLoRA, TritonLoRA]
